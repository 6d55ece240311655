package tollgate

import (
	"context"
	"sync"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
)

// health holds the circuit breakers that keep a failing store from being
// asked: one for the store, or, for a RedisStore on a Redis Cluster, one
// per master, so that a dead master sends its own keys to the failure
// policy and no other master's.
// It is safe for concurrent use.
type health struct {
	settings breaker.Settings
	// budget is the longest a store call takes while this process runs;
	// 0 when the store cannot tell (see callBudgeter).
	budget time.Duration
	// one serves every store but a Cluster, and a Cluster's keys whose
	// master the client cannot name.
	one     *breaker.Breaker
	masters mastersStore // the store, when it is spread over masters; else nil
	nodes   sync.Map     // master address → *breaker.Breaker
}

// newHealth returns the breakers for store.
func newHealth(store Store, s breaker.Settings) *health {
	h := &health{one: breaker.New(s)}
	h.settings = h.one.Settings() // with the defaults filled in
	if cb, ok := store.(callBudgeter); ok {
		h.budget = cb.callBudget()
	}
	if m, ok := store.(mastersStore); ok && m.spread() {
		h.masters = m
	}
	return h
}

// forKey returns the breaker for a decision on key's plans: the breaker of
// the master that holds the key's slot, on a Cluster. Naming the master
// reads the client's slot map, which it loads on its first call.
func (h *health) forKey(ctx context.Context, key string, plans []Plan) *breaker.Breaker {
	if h.masters == nil {
		return h.one
	}
	addr, err := h.masters.masterOf(ctx, key, plans[0].Name)
	if err != nil {
		return h.one
	}
	if b, ok := h.nodes.Load(addr); ok {
		return b.(*breaker.Breaker)
	}
	b, _ := h.nodes.LoadOrStore(addr, breaker.New(h.settings))
	return b.(*breaker.Breaker)
}

// each calls f for every breaker.
func (h *health) each(f func(b *breaker.Breaker)) {
	f(h.one)
	h.nodes.Range(func(_, b any) bool {
		f(b.(*breaker.Breaker))
		return true
	})
}

// closed reports whether every breaker is closed.
func (h *health) closed() bool {
	all := true
	h.each(func(b *breaker.Breaker) { all = all && b.State() == breaker.Closed })
	return all
}

// state returns the state furthest from closed among the breakers: open,
// then half-open.
func (h *health) state() breaker.State {
	worst := breaker.Closed
	h.each(func(b *breaker.Breaker) {
		if s := b.State(); s == breaker.Open || s == breaker.HalfOpen && worst == breaker.Closed {
			worst = s
		}
	})
	return worst
}

// entered returns how many times the breakers together entered state s.
func (h *health) entered(s breaker.State) uint64 {
	n := uint64(0)
	h.each(func(b *breaker.Breaker) { n += b.Entered(s) })
	return n
}
