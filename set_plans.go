package tollgate

import (
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
)

// planTable is a Limiter's plans by name, replaced whole by SetPlans: a
// decision loads it once, so it sees one table from start to end.
type planTable struct {
	byName   map[string]*planEntry
	plans    []Plan // in the order given
	defaults *planEntry
	history  planHistory // what this table and those before it held of each name
}

// planHistory is what a Limiter's tables held of each plan name, a
// table's own and every one before it: whether the name is a concurrency
// plan, which it stays for the Limiter's life, the highest Version with
// InheritReset it had, never lowered, and how far its proportional
// versions scaled a bucket's tokens at most (nameHistory). Past
// maxHistoryNames names beyond a table's own, names it no longer holds
// are forgotten: their kind may change again, their reset versions fold
// into floor, which counts for every name, and their scale starts anew,
// under a new birth. The zero value holds none.
type planHistory struct {
	byName map[string]nameHistory
	floor  uint32
	births uint64 // the names first seen, or seen again once forgotten
}

// nameHistory is what a Limiter's tables held of one plan name.
type nameHistory struct {
	concurrency bool
	reset       uint32 // the highest Version with InheritReset; 0 if none

	// born numbers the name's history, anew once it was forgotten: a
	// scale of another birth tells nothing of this one's.
	born uint64
	// version is the highest Version the name had; top the largest
	// Capacity of its versioned plans since its last proportional version
	// (that one's included), 0 if none: the most a bucket's last
	// versioned capacity may be; props counts its proportional versions.
	version, props uint32
	top            int64
	// scale is the product, over the name's proportional versions, of
	// the new Capacity over top, each at most 1: at most what those
	// versions made of a token held since the first, though a key's
	// bucket met only some of them. 1 at birth.
	scale float64
}

// maxHistoryNames bounds the plan names whose history a table carries
// over from the tables before it, beyond its own.
const maxHistoryNames = 4096

// resetOf returns the highest reset version known for name; 0 if none.
func (h *planHistory) resetOf(name string) uint32 {
	return max(h.byName[name].reset, h.floor)
}

// under returns e after a table held plan p of its name, as a bucket
// takes a plan of a higher Version: a proportional one scales it.
func (e nameHistory) under(p *Plan) nameHistory {
	e.concurrency = p.Concurrency
	if p.Inherit == InheritReset {
		e.reset = max(e.reset, p.Version)
	}
	if p.Version == 0 {
		return e
	}
	switch {
	case p.Version > e.version && p.Inherit == InheritProportional:
		if e.top > 0 { // else the bucket scales by its own capacity: 1
			e.scale *= min(1, float64(p.Capacity)/float64(e.top))
		}
		e.top = p.Capacity
		e.props++
	default:
		e.top = max(e.top, p.Capacity)
	}
	e.version = max(e.version, p.Version)
	return e
}

// historyAfter returns the history of a table of plans that replaces old
// (nil at New).
func historyAfter(old *planTable, plans []Plan) planHistory {
	next := planHistory{byName: make(map[string]nameHistory, len(plans))}
	if old != nil {
		next.floor, next.births = old.history.floor, old.history.births
	}
	for i := range plans {
		p := &plans[i]
		e, ok := nameHistory{}, false
		if old != nil {
			e, ok = old.history.byName[p.Name]
		}
		if !ok {
			next.births++
			e = nameHistory{born: next.births, scale: 1}
		}
		next.byName[p.Name] = e.under(p)
	}
	if old == nil {
		return next
	}
	own := len(next.byName)
	for name, e := range old.history.byName {
		switch _, kept := next.byName[name]; {
		case kept:
		case len(next.byName) < own+maxHistoryNames:
			next.byName[name] = e
		default:
			next.floor = max(next.floor, e.reset)
		}
	}
	return next
}

// planEntry is a plan as a Limiter looks it up: a plan of its table, a
// resolver's variant of one, or a plan given to AllowPlans.
type planEntry struct {
	one    []Plan     // the plan alone, so that a decision on one plan builds no slice
	fp     string     // its fingerprint: the denial cache's name for it
	counts *planCount // its decisions, for Stats, shared by every plan of its name

	// variants are the other plans of this name seen so far (resolver
	// results, AllowPlans arguments), validated and fingerprinted once;
	// at most maxVariants, copied on write.
	variants atomic.Pointer[[]*planEntry]
}

// maxVariants bounds the variants kept per plan name. A resolver that
// returns more distinct plans for one name costs an allocation and a
// validation per decision beyond them, and still decides correctly.
const maxVariants = 16

// fingerprint names a plan for the denial cache by its name and every
// parameter the decision depends on, so that a denial remembered under
// one tier never answers for another (Envoy's local cache lacks this).
func fingerprint(p Plan) string {
	b := make([]byte, 0, 64)
	b = append(b, p.Name...)
	b = append(b, '#')
	b = strconv.AppendInt(b, p.Capacity, 10)
	b = append(b, '/')
	b = strconv.AppendFloat(b, p.Rate, 'g', -1, 64)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(p.Window), 10)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(p.Slots), 10)
	b = append(b, '/')
	b = strconv.AppendFloat(b, p.Suppress, 'g', -1, 64)
	b = append(b, '/')
	b = strconv.AppendUint(b, uint64(versionArg(&p)), 10)
	if p.Shadow {
		b = append(b, "/s"...)
	}
	if p.Concurrency {
		b = append(b, "/c"...)
	}
	return string(b)
}

// newEntry returns the entry of a validated plan.
func newEntry(p Plan, counts *planCount) *planEntry {
	return &planEntry{one: []Plan{p}, fp: fingerprint(p), counts: counts}
}

// variant returns the entry of plan *p, of e's name: e itself, a variant
// seen before, or a new one, which it validates first, with the Shadow
// flag its caller gave (shadow), before WithShadow set it.
func (e *planEntry) variant(p *Plan, shadow bool) (*planEntry, error) {
	if *p == e.one[0] {
		return e, nil
	}
	vs := e.variants.Load()
	if vs != nil {
		for _, v := range *vs {
			if *p == v.one[0] {
				return v, nil
			}
		}
	}
	if p.Concurrency != e.one[0].Concurrency {
		return nil, errKindOfPermits(p.Name)
	}
	given := *p
	given.Shadow = shadow
	if err := given.validate(); err != nil {
		return nil, err
	}
	v := newEntry(*p, e.counts)
	if vs == nil || len(*vs) < maxVariants {
		var next []*planEntry
		if vs != nil {
			next = append(next, *vs...)
		}
		next = append(next, v)
		e.variants.CompareAndSwap(vs, &next) // a lost race only forgets v
	}
	return v, nil
}

// newTable validates plans as New and SetPlans take them, and builds their
// table, every plan shadowed if shadow is set (WithShadow); counts returns
// the counters of a plan name.
func newTable(plans []Plan, shadow bool, counts func(name string) *planCount) (*planTable, error) {
	if len(plans) == 0 {
		return nil, fmt.Errorf("%w: no plans", ErrInvalidPlan)
	}
	t := &planTable{byName: make(map[string]*planEntry, len(plans))}
	for _, p := range plans {
		if err := p.validate(); err != nil {
			return nil, err
		}
		if shadow && p.Concurrency {
			return nil, errShadowedPermits
		}
		p.Shadow = p.Shadow || shadow
		if _, dup := t.byName[p.Name]; dup {
			return nil, fmt.Errorf("%w: plan name %q is given twice", ErrInvalidPlan, p.Name)
		}
		t.byName[p.Name] = newEntry(p, counts(p.Name))
		t.plans = append(t.plans, p)
	}
	t.defaults = t.byName[plans[0].Name]
	return t, nil
}

// leaseIn reports whether any of plans has a Lease.
func leaseIn(plans []Plan) bool {
	for i := range plans {
		if plans[i].Lease > 0 {
			return true
		}
	}
	return false
}

// SetPlans replaces the Limiter's plans with plans, checked as New checks
// them (ErrInvalidPlan): on an error the plans stay as they were. It is
// safe while the Limiter decides: each decision uses the old table or the
// new one, whole. A call that names no plan then uses plans[0].
//
// Buckets are kept by name: a plan whose Capacity grows keeps its tokens
// and refills toward the new Capacity, one whose Capacity shrinks is
// clamped to it at its next decision, and a changed Rate applies from the
// next decision on. A plan may not become, or stop being, a concurrency
// plan (ErrInvalidPlan), also by way of a table without it: its callers
// Acquire or Allow by its kind, and its permits or its bucket would be
// overwritten by the other kind's decisions; nor
// may plans[0] be of another kind than the old first plan, for the calls
// that name no plan. While
// instances with the old plans and the new run side by side, a key's
// admissions stay within max(old, new) Capacity + max(old, new) Rate ×
// elapsed time (docs/tiers.md). It forgets
// every remembered denial: under the new plans, or back under the old
// after a round trip, a bucket may hold tokens that a denial remembered
// under the old plans says it lacks. Stats keeps counting each name, also
// one the table no longer holds. Of concurrent calls, each is checked
// against the table it replaces.
func (l *Limiter) SetPlans(plans []Plan) error {
	t, err := newTable(plans, l.shadowAll, l.stats.plan)
	if err != nil {
		return err
	}
	for {
		old := l.table.Load()
		if err := l.replaces(old, t); err != nil {
			return err
		}
		t.history = historyAfter(old, t.plans)
		if l.table.CompareAndSwap(old, t) { // else another SetPlans landed: check against its table
			break
		}
	}
	if l.denials != nil { // nil when the cache is off
		l.denials.ForgetAll()
	}
	return nil
}

// replaces checks that table t may replace old (nil at New): no plan
// changes its kind, nor the default plan, and the stores hold what its
// plans need.
func (l *Limiter) replaces(old, t *planTable) error {
	if old != nil {
		for _, p := range t.plans {
			if e, ok := old.history.byName[p.Name]; ok && e.concurrency != p.Concurrency {
				return errKindOfPermits(p.Name)
			}
		}
		if old.defaults.one[0].Concurrency != t.defaults.one[0].Concurrency {
			return errKindOfDefault
		}
	}
	if l.leases == nil && l.mem == nil && leaseIn(t.plans) {
		return fmt.Errorf("%w: Plan.Lease needs a store, and a fallback store, that hold reservations", errUnsupported(modeHold))
	}
	if !l.permitsHeld && slices.ContainsFunc(t.plans, func(p Plan) bool { return p.Concurrency }) {
		return fmt.Errorf("%w: a concurrency plan needs a store, and a fallback store, that hold permits", errUnsupported(modeAcquire))
	}
	return nil
}
