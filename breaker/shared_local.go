package breaker

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// localCircuit is a Fallback breaker of one key.
type localCircuit struct {
	mu sync.Mutex
	c  circuit
}

// degradeAcquire decides a call by the failure policy, Redis having failed
// with cause.
func (b *Shared) degradeAcquire(key string, now int64, cause error) (Ticket, error) {
	b.stats.degraded.Add(1)
	switch b.policy {
	case FailOpen:
		return Ticket{t: &ticket{b: b, key: key, start: now, mode: modeFailOpen}}, nil
	case FailClosed:
		return Ticket{}, fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	lc := b.localCircuit(key, now)
	token := rand.Uint64() | 1
	lc.mu.Lock()
	r := lc.c.step(localUs(now), input{op: opAcquire, token: token}, b.p)
	lc.mu.Unlock()
	if r.from != 0 {
		b.transitioned(key, r, opAcquire, true)
	}
	switch r.grant {
	case grantClosed:
		b.stats.granted[Closed].Add(1)
		return Ticket{t: &ticket{b: b, key: key, gen: r.gen, start: now, state: Closed, mode: modeLocal}}, nil
	case grantProbe:
		b.stats.granted[HalfOpen].Add(1)
		return Ticket{t: &ticket{b: b, key: key, gen: r.gen, token: token, start: now, state: HalfOpen, mode: modeLocal}}, nil
	}
	b.stats.rejected[r.state].Add(1)
	return Ticket{RetryAfter: time.Duration(r.wait) * time.Microsecond}, ErrOpen
}

// localCircuit returns key's Fallback breaker, seeding a new one from what
// the instance last read from Redis: an open breaker stays open until its
// open time ends, a forced one until Redis answers again, and a half-open
// one probes at once.
func (b *Shared) localCircuit(key string, now int64) *localCircuit {
	b.mu.Lock()
	defer b.mu.Unlock()
	if lc := b.local[key]; lc != nil {
		return lc
	}
	if len(b.local) >= maxKeys {
		b.local = map[string]*localCircuit{}
	}
	lc := &localCircuit{}
	if m := b.memos[key]; m != nil {
		lc.c.gen = m.gen.Load()
		switch m.state.Load() {
		case stateOpen:
			lc.c.state, lc.c.openUntil = stateOpen, localUs(max(m.openUntil.Load(), now))
			if m.held.Load() {
				lc.c.held, lc.c.openUntil = true, 0
			}
		case stateHalfOpen:
			lc.c.state, lc.c.openUntil = stateOpen, localUs(now)
		}
	}
	b.local[key] = lc
	b.nlocal.Store(int32(len(b.local)))
	return lc
}

// dropLocal forgets every Fallback breaker once Redis answers again.
func (b *Shared) dropLocal(string) {
	b.mu.Lock()
	b.local = map[string]*localCircuit{}
	b.nlocal.Store(0)
	b.mu.Unlock()
}

// doneLocal reports a Fallback ticket's outcome to its local breaker, if
// that breaker still exists.
func (b *Shared) doneLocal(tk *ticket, bt batch, now int64) error {
	b.mu.RLock()
	lc := b.local[tk.key]
	b.mu.RUnlock()
	if lc == nil {
		return nil // Redis is back; its state wins
	}
	lc.mu.Lock()
	r := lc.c.step(localUs(now), input{op: opRecord, token: tk.token, gen: tk.gen, b: bt}, b.p)
	lc.mu.Unlock()
	if r.from != 0 {
		b.transitioned(tk.key, r, opRecord, true)
	}
	if r.ignored == 1 {
		b.stats.stale.Add(1)
		return ErrStale
	}
	return nil
}

// localUs converts the instance's clock (ns) to the µs a Fallback breaker
// runs on, which must not be negative: the window's steps are indexed by
// it.
func localUs(ns int64) int64 { return ns/1000 + 1<<50 }
