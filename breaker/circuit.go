package breaker

// This file holds the state machine of a Shared breaker as pure Go: the
// same steps as circuit_breaker.lua, on a struct instead of a Redis
// hash and on a time the caller passes. The Fallback policy runs it
// locally while Redis is down, and TestCircuitAgreesWithScript feeds both
// the same steps and demands the same replies.

import (
	_ "embed"
	"slices"

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
// when it expires, in µs; used means its probe succeeded. A lease is free
// again once it expires, used or not.
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
	if in.op == opRead {
		// A read writes nothing back, as the script's does not: what it
		// brings back or forgets is read again by the next step.
		cp := *c
		cp.leases = slices.Clone(c.leases)
		c = &cp
	}
	t := &turn{c: c, now: now, p: p, slot: c.align(now, p)}
	c.bringBack(now, p)
	s0, g0 := c.state, c.gen
	var r reply
	if in.op == opAcquire || in.op == opRecord {
		r.ignored = t.record(in)
	}
	switch in.op {
	case opAcquire:
		t.acquire(in.token, &r)
	case opForceOpen:
		t.open()
		c.held, c.openUntil = true, 0
	case opForceClosed:
		t.closeIt()
	case opReset:
		t.closeIt()
		c.trips, c.failedProbes = 0, 0
	}
	c.reply(&r, now, p)
	if c.gen != g0 {
		r.from = s0 + 1
	}
	return r
}

// align sizes c's leases to p's probes, starts afresh every window step
// that does not count at now (see span), and returns now's slot.
func (c *circuit) align(now int64, p params) int64 {
	for len(c.leases) < int(p.probes) {
		c.leases = append(c.leases, lease{})
	}
	c.leases = c.leases[:p.probes]
	slot := now / max(p.window/10, 1)
	first, last := c.span(slot)
	for i := range c.steps {
		if st := c.steps[i]; !c.hasStep[i] || st.slot < first || st.slot > last {
			c.steps[i] = windowStep{slot: slot}
		}
		c.hasStep[i] = true
	}
	return slot
}

// span returns the first and last window slots that count at slot: the ten
// up to it, or, after a clock step back, the ten up to the newest step
// that holds counts, while that one is at most a window ahead. A newest
// step further ahead, which no step back within a window explains, leaves
// none (first > last).
func (c *circuit) span(slot int64) (first, last int64) {
	newest := slot
	for i, st := range c.steps {
		if c.hasStep[i] && st.calls+st.failures+st.slow > 0 {
			newest = max(newest, st.slot)
		}
	}
	if newest > slot+9 {
		return 1, 0
	}
	return newest - 9, newest
}

// turn is one step of a circuit: its instant now (µs), its settings p and
// now's window slot.
type turn struct {
	c         *circuit
	now, slot int64
	p         params
}

// clear empties the window, the leases and the runs of successes.
func (t *turn) clear() {
	c := t.c
	for i := range c.steps {
		c.steps[i] = windowStep{slot: t.slot}
	}
	for i := range c.leases {
		c.leases[i] = lease{}
	}
	c.consecutive, c.probeSuccesses = 0, 0
}

// open opens the breaker for OpenFor, doubled for each failed probe up to
// MaxOpenFor.
func (t *turn) open() {
	c, p := t.c, t.p
	d := p.openFor
	for range c.failedProbes {
		if d >= p.maxOpenFor {
			break
		}
		d *= 2
	}
	d = min(d, max(p.maxOpenFor, p.openFor))
	c.state, c.gen, c.openUntil, c.held = stateOpen, c.gen+1, t.now+d, false
	t.clear()
}

// closeIt closes the breaker.
func (t *turn) closeIt() {
	c := t.c
	c.state, c.gen, c.openUntil, c.failedProbes, c.held = stateClosed, c.gen+1, 0, 0, false
	t.clear()
}

// sums returns the calls, failures and slow calls in c's window.
func (c *circuit) sums() (n, f, w int64) {
	for _, st := range c.steps {
		n, f, w = n+st.calls, f+st.failures, w+st.slow
	}
	return n, f, w
}

// record counts in's outcomes, of calls or of a probe, and returns 1 if
// they were ignored: calls of another generation or state, or a probe
// whose lease is not held.
func (t *turn) record(in input) int64 {
	b := in.b
	switch {
	case in.op == opRecord && in.token != 0:
		return t.probed(in)
	case b.calls > 0:
		c := t.c
		if c.state != stateClosed || (in.gen != -1 && in.gen != c.gen) {
			return 1
		}
		st := &c.steps[t.slot%10]
		st.slot = t.slot // an empty step may carry an older slot that is still in the window
		st.calls, st.failures, st.slow = st.calls+b.calls, st.failures+b.failures, st.slow+b.slow
		if b.succeeded {
			c.consecutive = b.run
		} else {
			c.consecutive += b.run
		}
		if (b.failures > 0 || b.slow > 0) && t.trips() {
			c.trips, c.failedProbes = c.trips+1, 0
			t.open()
		}
	}
	return 0
}

// trips reports whether the window's failure or slow rate, or the run of
// failures, trips the breaker.
func (t *turn) trips() bool {
	n, f, w := t.c.sums()
	p := t.p
	return (n >= p.minCalls && (f*1_000_000 >= p.rate*n || (p.slowRate > 0 && w*1_000_000 >= p.slowRate*n))) ||
		(p.consecutive > 0 && t.c.consecutive >= p.consecutive)
}

// probed counts a probe's outcome, and returns 1 if its lease is not
// held: the probe's call reopens the breaker if it failed, releases its
// lease if it made none, and counts towards closing if it succeeded.
func (t *turn) probed(in input) int64 {
	c := t.c
	held := -1
	if c.state == stateHalfOpen && in.gen == c.gen {
		for i, l := range c.leases {
			if !l.used && l.token == in.token && l.expires > t.now {
				held = i
			}
		}
	}
	switch {
	case held < 0:
		return 1
	case in.b.calls == 0:
		c.leases[held] = lease{}
	case in.b.failures > 0:
		c.failedProbes++
		t.open()
	default:
		c.leases[held].used = true
		c.probeSuccesses++
		if c.probeSuccesses >= t.p.probes {
			t.closeIt()
		}
	}
	return 0
}

// acquire asks for a call under token: an open breaker whose time is up
// turns half-open; a closed one grants; a half-open one grants a free
// probe lease, or tells r how long until one may be free.
func (t *turn) acquire(token uint64, r *reply) {
	c, now := t.c, t.now
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
		// A lease is free once it expires, used or not: a used lease
		// whose success was not counted (Probes lowered while probing)
		// holds its slot for at most ProbeTimeout.
		free := -1
		for i := len(c.leases) - 1; i >= 0; i-- {
			if l := c.leases[i]; l.token == 0 || l.expires <= now {
				free = i
			}
		}
		if free >= 0 {
			c.leases[free] = lease{token: token, expires: now + t.p.probeTimeout}
			r.grant = grantProbe
			return
		}
		r.wait = maxExact
		for _, l := range c.leases {
			r.wait = min(r.wait, l.expires-now)
		}
		if r.wait == maxExact {
			r.wait = t.p.probeTimeout
		}
	}
}

// reply fills in r's state, wait and counts as of now.
func (c *circuit) reply(r *reply, now int64, p params) {
	switch {
	case c.state == stateOpen && c.held:
		r.wait = p.openFor
	case c.state == stateOpen:
		r.wait = max(c.openUntil-now, 0)
	}
	r.state, r.gen, r.trips = c.state, c.gen, c.trips
	r.calls, r.failures, r.slow = c.sums()
	if c.held {
		r.held = 1
	}
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
