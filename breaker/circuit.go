package breaker

// This file holds the state machine of a Shared breaker as pure Go: the
// same steps as circuit_breaker.lua, on a struct instead of a Redis
// hash and on a time the caller passes. The Fallback policy runs it
// locally while Redis is down, and TestCircuitAgreesWithScript feeds both
// the same steps and demands the same replies.

import (
	_ "embed"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// luaCircuit runs one step of a distributed circuit breaker on its one
// key; circuit holds the same state machine. Its header documents its
// KEYS, ARGV and reply.
//
//go:embed circuit_breaker.lua
var luaCircuit string

// script is the one script that reads and changes a Shared breaker.
var script = redisscript.New(luaCircuit)

// boolInt returns 1 for true, as the script takes flags.
func boolInt(v bool) int {
	if v {
		return 1
	}
	return 0
}

// Script operations, as ARGV[1] of circuit_breaker.lua takes them.
const (
	opAcquire     = 1
	opRecord      = 2
	opRead        = 3
	opForceOpen   = 4
	opForceClosed = 5
	opReset       = 6
)

// Grants, as the reply's fourth element.
const (
	grantNone   = 0
	grantClosed = 1
	grantProbe  = 2
)

// maxExact is 2^53, the largest whole number Lua's doubles hold exactly.
const maxExact = 1 << 53

// params are the settings as the script takes them: microseconds, and
// rates in parts per million.
type params struct {
	window, minCalls, rate, slowRate, consecutive int64
	openFor, maxOpenFor, probes, probeTimeout     int64
}

// args returns p as ARGV[9] onwards.
func (p params) args() []any {
	return []any{p.window, p.minCalls, p.rate, p.slowRate, p.consecutive,
		p.openFor, p.maxOpenFor, p.probes, p.probeTimeout}
}

// batch is the outcomes a step records: calls, failures and slow calls, the
// trailing run of failures, and whether any call succeeded. A probe's
// outcome is a batch of one call; a probe released unused, of none.
type batch struct {
	calls, failures, slow, run int64
	succeeded                  bool
}

// add returns the outcomes of a and then o.
func (a batch) add(o batch) batch {
	a.calls += o.calls
	a.failures += o.failures
	a.slow += o.slow
	if o.succeeded {
		a.run, a.succeeded = o.run, true
	} else {
		a.run += o.run
	}
	return a
}

// input is one step: the op, the probe token (0: none), the generation the
// outcomes belong to (-1: the current one, counted only while closed) and
// the outcomes.
type input struct {
	op    int
	token uint64
	gen   int64
	b     batch
}

// reply is the script's reply, field for field.
type reply struct {
	state, gen, wait, grant, from, trips, calls, failures, slow int64
	foreign, held, ignored                                      int64
}

// replyLen is the number of integers in the script's reply.
const replyLen = 12

// lease is one half-open probe lease: the holder's token (0: free) and
// when it expires, in µs; used means its probe succeeded.
type lease struct {
	token   uint64
	expires int64
	used    bool
}

// windowStep counts the calls of one tenth of the window: slot is which
// tenth (now / width).
type windowStep struct {
	slot, calls, failures, slow int64
}

// circuit is one breaker's state, as the script's hash holds it. Its zero
// value is a closed breaker of generation 0, as a missing key is.
type circuit struct {
	state, gen, openUntil, failedProbes int64
	held                                bool // forced open
	probeSuccesses, consecutive, trips  int64
	leases                              []lease
	steps                               [10]windowStep
	hasStep                             [10]bool
}

// step applies in at now (µs) with settings p, and returns the reply the
// script would give. The comments of circuit_breaker.lua explain each rule.
func (c *circuit) step(now int64, in input, p params) reply {
	for len(c.leases) < int(p.probes) {
		c.leases = append(c.leases, lease{})
	}
	c.leases = c.leases[:p.probes]
	width := max(p.window/10, 1)
	slot := now / width
	cur := slot % 10
	for i := range c.steps {
		if st := c.steps[i]; !c.hasStep[i] || st.slot <= slot-10 || st.slot > slot {
			c.steps[i] = windowStep{slot: slot}
		}
		c.hasStep[i] = true
	}
	c.bringBack(now, p)
	s0, g0 := c.state, c.gen
	var r reply

	clear := func() {
		for i := range c.steps {
			c.steps[i] = windowStep{slot: slot}
		}
		for i := range c.leases {
			c.leases[i] = lease{}
		}
		c.consecutive, c.probeSuccesses = 0, 0
	}
	open := func() {
		d := p.openFor
		for range c.failedProbes {
			if d >= p.maxOpenFor {
				break
			}
			d *= 2
		}
		d = min(d, max(p.maxOpenFor, p.openFor))
		c.state, c.gen, c.openUntil, c.held = stateOpen, c.gen+1, now+d, false
		clear()
	}
	closeIt := func() {
		c.state, c.gen, c.openUntil, c.failedProbes, c.held = stateClosed, c.gen+1, 0, 0, false
		clear()
	}
	sums := func() (n, f, w int64) {
		for _, st := range c.steps {
			n, f, w = n+st.calls, f+st.failures, w+st.slow
		}
		return n, f, w
	}

	probe := in.op == opRecord && in.token != 0
	if in.op == opAcquire || in.op == opRecord {
		b := in.b
		switch {
		case b.calls > 0 && !probe:
			if c.state != stateClosed || (in.gen != -1 && in.gen != c.gen) {
				r.ignored = 1
				break
			}
			st := &c.steps[cur]
			st.slot = slot // an empty step may carry an older slot that is still in the window
			st.calls, st.failures, st.slow = st.calls+b.calls, st.failures+b.failures, st.slow+b.slow
			if b.succeeded {
				c.consecutive = b.run
			} else {
				c.consecutive += b.run
			}
			if b.failures > 0 || b.slow > 0 {
				n, f, w := sums()
				if (n >= p.minCalls && (f*1_000_000 >= p.rate*n || (p.slowRate > 0 && w*1_000_000 >= p.slowRate*n))) ||
					(p.consecutive > 0 && c.consecutive >= p.consecutive) {
					c.trips, c.failedProbes = c.trips+1, 0
					open()
				}
			}
		case probe:
			held := -1
			if c.state == stateHalfOpen && in.gen == c.gen {
				for i, l := range c.leases {
					if !l.used && l.token == in.token && l.expires > now {
						held = i
					}
				}
			}
			switch {
			case held < 0:
				r.ignored = 1
			case b.calls == 0:
				c.leases[held] = lease{}
			case b.failures > 0:
				c.failedProbes++
				open()
			default:
				c.leases[held].used = true
				c.probeSuccesses++
				if c.probeSuccesses >= p.probes {
					closeIt()
				}
			}
		}
	}

	switch in.op {
	case opAcquire:
		if c.state == stateOpen && !c.held && now >= c.openUntil {
			c.state, c.gen, c.probeSuccesses = stateHalfOpen, c.gen+1, 0
			for i := range c.leases {
				c.leases[i] = lease{}
			}
		}
		switch c.state {
		case stateClosed:
			r.grant = grantClosed
		case stateHalfOpen:
			free := -1
			for i := len(c.leases) - 1; i >= 0; i-- {
				if l := c.leases[i]; l.token == 0 || (!l.used && l.expires <= now) {
					free = i
				}
			}
			if free >= 0 {
				c.leases[free] = lease{token: in.token, expires: now + p.probeTimeout}
				r.grant = grantProbe
			} else {
				r.wait = maxExact
				for _, l := range c.leases {
					if !l.used {
						r.wait = min(r.wait, l.expires-now)
					}
				}
				if r.wait == maxExact {
					r.wait = p.probeTimeout
				}
			}
		}
	case opForceOpen:
		open()
		c.held, c.openUntil = true, 0
	case opForceClosed:
		closeIt()
	case opReset:
		closeIt()
		c.trips, c.failedProbes = 0, 0
	}

	switch {
	case c.state == stateOpen && c.held:
		r.wait = p.openFor
	case c.state == stateOpen:
		r.wait = max(c.openUntil-now, 0)
	}
	r.state, r.gen, r.trips = c.state, c.gen, c.trips
	r.calls, r.failures, r.slow = sums()
	if c.held {
		r.held = 1
	}
	if c.gen != g0 {
		r.from = s0 + 1
	}
	return r
}

// bringBack brings an open time or a lease further ahead of now (µs) than
// p allows back to the longest p allows, as the script does: a clock that
// stepped back, or a planted value, then holds the breaker no longer.
func (c *circuit) bringBack(now int64, p params) {
	if longest := now + max(p.maxOpenFor, p.openFor); c.state == stateOpen && !c.held && c.openUntil > longest {
		c.openUntil = longest
	}
	for i := range c.leases {
		c.leases[i].expires = min(c.leases[i].expires, now+p.probeTimeout)
	}
}

// States as the script numbers them. They are the values of State, which
// a test checks.
const (
	stateClosed   = int64(Closed)
	stateOpen     = int64(Open)
	stateHalfOpen = int64(HalfOpen)
)
