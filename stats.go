package tollgate

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// Stats is a snapshot of what a Limiter has done since New, for metrics:
// the Prometheus and OpenTelemetry adapters read it when they are scraped
// or collected. Counters only grow. No field ever holds a caller's key.
type Stats struct {
	// Plans holds the decisions of each plan, in the order given to New.
	// Plan finds one by name.
	Plans []PlanStats

	// StoreCalls is the number of calls to the store that the breaker let
	// through; a MemoryStore, which cannot fail, is not counted.
	StoreCalls uint64
	// StoreErrors counts the failed store calls by class: "timeout",
	// "network", "canceled" (the store's own context, not the caller's),
	// "bad-reply", Redis's error class such as "OOM", "READONLY",
	// "NOPERM" or "BUSY", and "other". Calls that failed through the
	// caller's doing (bad input, its context ended or its deadline
	// passed) are not failures. "stalled" counts the calls that timed
	// out because this process was stopped or starved of CPU (their
	// timeout came later than the client's timeouts allow): the failure
	// policy answered them, but the breaker did not count them.
	StoreErrors map[string]uint64
	// StoreLatency counts the store calls by duration: StoreLatency[i] is
	// the number that took at most LatencyBounds[i], and the last element
	// counts those that took longer than every bound.
	StoreLatency []uint64
	// LatencyBounds are the upper bounds of StoreLatency's buckets: 50µs to
	// 1s, for Redis calls that take a fraction of a millisecond when
	// healthy and up to the client's timeout when not.
	LatencyBounds []time.Duration
	// StoreTime is the total duration of the store calls.
	StoreTime time.Duration

	// Breaker is the state of the breaker in front of the store; always
	// breaker.Closed for a MemoryStore, which has none. On a Redis
	// Cluster each master has a breaker of its own, and Breaker is the
	// state furthest from closed among them: open, then half-open.
	Breaker breaker.State
	// BreakerOpened, BreakerHalfOpened and BreakerClosed count the
	// transitions into each state, of every master's breaker together on
	// a Cluster. BreakerOpened counts trips, from closed: a failed probe,
	// which opens the breaker again once per Cooldown during a long
	// outage, is not a trip.
	BreakerOpened, BreakerHalfOpened, BreakerClosed uint64
	// Outage is true from the moment the breaker trips until a call
	// succeeds with the breaker closed and no call failed for two
	// Cooldowns: through a partial outage, it stays true while the breaker
	// closes and trips again.
	Outage bool
	// ScriptLoads is the number of times a RedisStore sent its scripts'
	// source after Redis answered NOSCRIPT; 0 for other stores.
	ScriptLoads int64
	// FleetSize is the most instances alive that the last three
	// heartbeats counted (WithFleet): the fallback enforces 1/FleetSize
	// of each plan during an outage. 0 without WithFleet or before the
	// first heartbeat.
	FleetSize int64

	// Reservations counts reservations and their settlements: those of
	// Reserve, and the leases a Limiter takes for plans with a Lease,
	// which are reservations too.
	Reservations struct {
		// Held is the number of reservations granted.
		Held uint64
		// Settled is the number settled, expired holds included, and
		// Expired the number whose hold was gone (ErrHoldExpired).
		Settled, Expired uint64
		// Refunded, Charged and Uncharged are Settlement's fields
		// summed, in tokens: given back, taken beyond reservations, and
		// not taken because a bucket's debt would have passed one
		// capacity.
		Refunded, Charged, Uncharged uint64
	}

	// Permits counts the Acquire calls of concurrency plans
	// (Plan.Concurrency) and their permits.
	Permits struct {
		// Granted and Refused count Acquire calls, by their outcome;
		// not those on a key exempt from every plan (ErrExempt).
		Granted, Refused uint64
		// Released counts the Permits released while held, and Lost
		// those whose lease had ended when this Limiter renewed or
		// released them (ErrPermitLost). Unreleased counts the releases
		// the store failed: their permits come back when their lease
		// ends.
		Released, Lost, Unreleased uint64
		// Reclaimed counts the permits, of any instance, whose lease had
		// ended when this Limiter's Acquire, renewal or release found
		// them, its own lost ones included: holders that died, or lost
		// the store, without releasing. Redis deletes a key once every
		// lease on it has ended, and its permits with it, uncounted.
		Reclaimed uint64
		// Adopted counts the Permits that the fallback granted during an
		// outage and that moved into the store once it answered again,
		// so that it counts them while their holders work.
		Adopted uint64
	}
}

// PlanStats counts the decisions that took tokens, by the plan that bound
// them (see Result). Peeks are not counted.
type PlanStats struct {
	// Plan is the plan's name.
	Plan string
	// Allowed and Denied count decisions by Source: Allowed[SourceStore]
	// is the number the store allowed. Exempt decisions (ErrExempt) are
	// not counted. AllowedBy, DeniedBy and the totals read them without
	// indexing.
	Allowed, Denied [numSources]uint64
	// ShadowDenied counts the decisions that this plan, shadowed, would
	// have denied had it been enforced (Plan.Shadow, WithShadow), whichever
	// plan bound them.
	ShadowDenied uint64
	// PermitsHeld is, for a concurrency plan (Plan.Concurrency), the
	// permits of it this Limiter holds now, on every key; 0 for others.
	PermitsHeld int64
}

// Plan returns the figures of the plan named name, and false if s has
// none: no plan of that name is in the Limiter's table, and no AllowPlans
// call has decided by one.
func (s Stats) Plan(name string) (PlanStats, bool) {
	for _, p := range s.Plans {
		if p.Plan == name {
			return p, true
		}
	}
	return PlanStats{}, false
}

// AllowedBy returns the number of decisions that src allowed; 0 for
// SourceExempt, which is not counted, or a Source out of range.
func (p PlanStats) AllowedBy(src Source) uint64 { return sourceCount(&p.Allowed, src) }

// DeniedBy returns the number of decisions that src denied; 0 for
// SourceExempt, which is not counted, or a Source out of range.
func (p PlanStats) DeniedBy(src Source) uint64 { return sourceCount(&p.Denied, src) }

// AllowedTotal returns the number of decisions allowed, whatever decided.
func (p PlanStats) AllowedTotal() uint64 { return sourceTotal(&p.Allowed) }

// DeniedTotal returns the number of decisions denied, whatever decided.
func (p PlanStats) DeniedTotal() uint64 { return sourceTotal(&p.Denied) }

// sourceCount returns n[src], or 0 for a src out of n's range.
func sourceCount(n *[numSources]uint64, src Source) uint64 {
	if int(src) >= len(n) {
		return 0
	}
	return n[src]
}

// sourceTotal returns the sum of n.
func sourceTotal(n *[numSources]uint64) (total uint64) {
	for _, c := range n {
		total += c
	}
	return total
}

// stats sums the counters of the plan named name.
func (pc *planCount) stats(name string) PlanStats {
	ps := PlanStats{Plan: name}
	for st := range stripes {
		c := &pc.decisions[st]
		for src := range numSources {
			ps.Denied[src] += c.n[0][src].Load()
			ps.Allowed[src] += c.n[1][src].Load()
		}
		ps.ShadowDenied += pc.shadow[st].n.Load()
	}
	return ps
}

// latencyBounds are Stats.LatencyBounds.
var latencyBounds = [...]time.Duration{
	50 * time.Microsecond, 100 * time.Microsecond, 250 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2500 * time.Microsecond, 5 * time.Millisecond, 10 * time.Millisecond,
	25 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond,
	500 * time.Millisecond, time.Second,
}

// stripes is the number of copies of each decision counter: decisions on
// other cores land on other cache lines, so counting does not make the
// cores wait for each other.
const (
	stripeBits = 3
	stripes    = 1 << stripeBits
)

// planCounters are one stripe of one plan's decision counters, by outcome
// and Source: 2 × 5 × 8 bytes, padded to two cache lines, so that no two
// stripes share one.
type planCounters struct {
	n [2][numSources]atomic.Uint64
	_ [128 - 2*numSources*8]byte
}

// planStripes are one plan's decision counters.
type planStripes [stripes]planCounters

// count counts the decision in *r.
func (p *planStripes) count(r *Result) {
	if r.Source >= numSources {
		return
	}
	st := &p[stripe(r)]
	if r.Allowed {
		st.n[1][r.Source].Add(1)
	} else {
		st.n[0][r.Source].Add(1)
	}
}

// planCount is what a Limiter counts of one plan name.
type planCount struct {
	shadow [stripes]struct {
		n atomic.Uint64
		_ [56]byte // the next stripe's counter on another cache line
	}
	decisions planStripes // not on the object's first cache line: counted there, decisions on two cores measured slower
}

// counters are what a Limiter counts for Stats. Each counter a decision
// touches has a copy per stripe, so that cores rarely write one cache line.
type counters struct {
	calls        []storeCounters
	reservations reservationCounters
	permits      permitCounters

	mu     sync.Mutex
	errors map[string]uint64
	plans  map[string]*planCount // by plan name, kept across SetPlans
}

// plan returns the counters of the plan named name, new if it has none.
func (c *counters) plan(name string) *planCount {
	c.mu.Lock()
	defer c.mu.Unlock()
	pc, ok := c.plans[name]
	if !ok {
		pc = new(planCount)
		c.plans[name] = pc
	}
	return pc
}

// countShadow counts, for each shadowed plan of the decision in *r that
// would have denied, a would-be denial under that plan's name. entry is
// the plan's for a decision on one plan, and nil for a chain.
func (l *Limiter) countShadow(r *Result, entry *planEntry, t *planTable) {
	s := stripe(r)
	if entry != nil {
		entry.counts.shadow[s].n.Add(1)
		return
	}
	for _, pr := range r.chain {
		if e := l.entryOf(t, pr.Plan); pr.WouldDeny && e != nil {
			e.counts.shadow[s].n.Add(1)
		}
	}
}

// storeCounters are one stripe of the store calls' counters.
type storeCounters struct {
	time    atomic.Int64 // ns
	latency [len(latencyBounds) + 1]atomic.Uint64
	_       [64]byte // the next stripe's counters on other cache lines
}

func newCounters() counters {
	return counters{
		calls:  make([]storeCounters, stripes),
		errors: make(map[string]uint64),
		plans:  make(map[string]*planCount),
	}
}

// stripe picks a stripe from the address of r. A Result is built on the
// deciding goroutine's stack, so goroutines, and with them the cores,
// mostly count on different cache lines. A random number per decision
// spreads them as well but costs more than the whole count, and one set
// of counters for all cores slows cores that decide at once.
func stripe(r *Result) int {
	return int(uint64(uintptr(unsafe.Pointer(r))) * 0x9E3779B97F4A7C15 >> (64 - stripeBits))
}

// storeCall counts a call to the store for the decision into *r, and its
// failure if err is not nil.
func (c *counters) storeCall(r *Result, elapsed time.Duration, err error) {
	sc := &c.calls[stripe(r)]
	sc.time.Add(int64(elapsed))
	b := 0
	for b < len(latencyBounds) && elapsed > latencyBounds[b] {
		b++
	}
	sc.latency[b].Add(1)
	if err != nil {
		class := errorClass(err)
		c.mu.Lock()
		c.errors[class]++
		c.mu.Unlock()
	}
}

// errorClass names the class of a store failure, for Stats.StoreErrors.
func errorClass(err error) string {
	var rerr *redisscript.Error
	var nerr net.Error
	switch {
	case err == errStalled:
		return "stalled"
	case errors.As(err, &rerr):
		return rerr.Class
	case errors.Is(err, redisscript.ErrBadReply):
		return "bad-reply"
	case errors.As(err, &nerr) && nerr.Timeout(), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.As(err, &nerr):
		return "network"
	}
	return "other"
}

// Stats returns a snapshot of what the Limiter has done since New. It is
// safe to call while the Limiter decides; each counter is read once, so
// counters read a moment apart may disagree by the decisions in between.
// Plans lists the plans of the current table (New, SetPlans) in order,
// then, by name, other plans that decided: AllowPlans's.
func (l *Limiter) Stats() Stats {
	t := l.table.Load()
	s := Stats{
		Plans:         make([]PlanStats, 0, len(t.plans)),
		StoreLatency:  make([]uint64, len(latencyBounds)+1),
		LatencyBounds: append([]time.Duration(nil), latencyBounds[:]...), // the caller's to change
		StoreErrors:   make(map[string]uint64),
		Outage:        l.outage.active(),
	}
	for i := range l.stats.calls {
		sc := &l.stats.calls[i]
		s.StoreTime += time.Duration(sc.time.Load())
		for b := range sc.latency {
			n := sc.latency[b].Load()
			s.StoreLatency[b] += n
			s.StoreCalls += n
		}
	}
	for _, p := range t.plans {
		s.Plans = append(s.Plans, t.byName[p.Name].counts.stats(p.Name))
	}
	l.stats.mu.Lock()
	for k, v := range l.stats.errors {
		s.StoreErrors[k] = v
	}
	var others []string
	for name := range l.stats.plans {
		if t.byName[name] == nil {
			others = append(others, name)
		}
	}
	l.stats.mu.Unlock()
	slices.Sort(others)
	for _, name := range others {
		s.Plans = append(s.Plans, l.stats.plan(name).stats(name))
	}
	if h := l.health; h != nil {
		s.Breaker = h.state()
		s.BreakerOpened = h.entered(breaker.Open)
		s.BreakerHalfOpened = h.entered(breaker.HalfOpen)
		s.BreakerClosed = h.entered(breaker.Closed)
	}
	if ss, ok := l.store.(scriptStore); ok {
		s.ScriptLoads = ss.ScriptLoads()
	}
	if l.fleet != nil {
		s.FleetSize = l.fleet.size.Load()
	}
	l.stats.reservations.snapshot(&s)
	l.stats.permits.snapshot(&s)
	l.book.snapshot(&s)
	return s
}
