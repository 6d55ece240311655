package tollgate

import (
	"errors"
	"fmt"
)

// mode says what a decision does with the tokens it asks about.
type mode uint8

const (
	// modeTake takes n tokens: Allow, AllowN, AllowPlans, Wait.
	modeTake mode = iota
	// modeRead takes nothing and reports whether n tokens would be
	// taken: Peek, PeekN.
	modeRead
	// modeHold takes n tokens and keeps them as a hold, to settle later:
	// Reserve, and the leases of Plan.Lease.
	modeHold
	// modeAcquire takes n permits of each concurrency plan, to release
	// later, and n tokens of every other plan: Acquire.
	modeAcquire
)

// op is what a store is asked to do: take, read for, or hold n tokens of
// the buckets of key's plans, all or nothing, in one atomic step. The
// Limiter has checked it.
type op struct {
	key   string
	n     int64 // tokens, at least 1
	mode  mode
	plans []Plan
	hold  *hold   // modeHold's, which the store that grants it fills in
	grant *permit // modeAcquire's, which the store that grants it fills in
}

// cost is the op in the terms of the bucket math and the scripts: the
// tokens taken, or, for a read, which takes nothing, minus the tokens
// read for.
func (o *op) cost() int64 {
	if o.mode == modeRead {
		return -o.n
	}
	return o.n
}

// settleOp is what a store is asked to settle: the hold of a reservation
// of n tokens of key's plans, of which used were used.
type settleOp struct {
	key     string
	plans   []Plan
	hold    *hold
	n, used int64
}

// request is one decision as it flows through a Limiter's steps (decide):
// the op the store is asked, and what the Limiter keeps beside it.
type request struct {
	op
	table *planTable // loaded once: a decision sees one table from start to end
	entry *planEntry // the plan's when there is one plan; nil for a chain
	given bool       // the caller gave the plans (AllowPlans)
	pk    string     // the denial cache's name for the plans, when it is asked
	over  uint64     // bit i: plan i is shadowed and its capacity is below n (overCost)
}

// errUnsupported is the error of a store asked for what it cannot do.
func errUnsupported(m mode) error {
	what := "holds (Reserve, Plan.Lease)"
	switch m {
	case modeRead:
		what = "reads for more than one token (PeekN)"
	case modeAcquire:
		what = "permits (Acquire)"
	}
	return fmt.Errorf("%w: the store does not do %s", errors.ErrUnsupported, what)
}
