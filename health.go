package tollgate

import (
	"context"
	"sync"
	"sync/atomic"
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
	epoch    time.Time // of the Limiter's clock
	// budget is the longest a store call takes while this process runs;
	// 0 when the store cannot tell (see callBudgeter).
	budget time.Duration
	// one serves every store but a Cluster; single is its node. A
	// Cluster's keys whose master the client cannot name have a node of
	// their own, under "" in nodes.
	one     *breaker.Breaker
	single  node
	masters mastersStore // the store, when it is spread over masters; else nil
	// nodes maps a master's address, "" for keys whose master the client
	// cannot name, to its *node.
	nodes sync.Map
	// retired counts the transitions of the breakers forgotten, by the
	// state entered.
	retired [3]atomic.Uint64
}

// node is the breaker of one master of a store spread over masters. A
// master can go for good (a failover promotes a replica at another
// address), and then no decision asks its breaker again: one that is not
// closed, and that no decision asked for a while, is forgotten, or it
// would keep the outage going for ever. A key of that master, if it comes
// back, gets a new breaker.
type node struct {
	b *breaker.Breaker
	// heard is when a call to the store through b last succeeded, to the
	// millisecond, or when the node was made if none has: ns since the
	// Limiter's epoch.
	heard atomic.Int64
	// asked is when a decision last asked for the breaker while it was not
	// closed, and seen when forget first found it not closed (0 when
	// closed), in UnixNano.
	asked, seen atomic.Int64
}

// newHealth returns the breakers for store, on the Limiter's clock, which
// counts from epoch.
func newHealth(store Store, s breaker.Settings, epoch time.Time) *health {
	h := &health{one: breaker.New(s), epoch: epoch}
	h.single.b = h.one
	h.settings = h.one.Settings() // with the defaults filled in
	if cb, ok := store.(callBudgeter); ok {
		h.budget = cb.callBudget()
	}
	if m, ok := store.(mastersStore); ok && m.spread() {
		h.masters = m
	}
	return h
}

// forKey returns the node whose breaker guards a decision on key's plans:
// the node of the master that holds the key's slot, on a Cluster. Naming
// the master reads the client's slot map, which it loads on its first
// call.
func (h *health) forKey(ctx context.Context, key string, plans []Plan) *node {
	if h.masters == nil {
		return &h.single
	}
	addr, err := h.masters.masterOf(ctx, key, plans[0].Name)
	if err != nil {
		addr = ""
	}
	v, ok := h.nodes.Load(addr)
	if !ok {
		n := &node{b: breaker.New(h.settings)}
		n.heard.Store(int64(time.Since(h.epoch))) // a new master is not silent yet
		v, _ = h.nodes.LoadOrStore(addr, n)
	}
	n := v.(*node)
	if n.b.State() != breaker.Closed {
		n.asked.Store(time.Now().UnixNano())
	}
	return n
}

// each calls f for every breaker.
func (h *health) each(f func(b *breaker.Breaker)) {
	f(h.one)
	h.nodes.Range(func(_, v any) bool {
		f(v.(*node).b)
		return true
	})
}

// forget drops the masters' breakers that are not closed and that no
// decision asked for since the longer of the breakers' Window and two
// Cooldowns, found not closed that long ago at least.
func (h *health) forget() {
	now := time.Now().UnixNano()
	idle := int64(max(h.settings.Window, 2*h.settings.Cooldown))
	h.nodes.Range(func(addr, v any) bool {
		n := v.(*node)
		switch {
		case n.b.State() == breaker.Closed:
			n.seen.Store(0)
		case n.seen.Load() == 0:
			n.seen.Store(now)
		case now-n.seen.Load() > idle && now-n.asked.Load() > idle && h.nodes.CompareAndDelete(addr, v):
			for s := range h.retired {
				h.retired[s].Add(n.b.Entered(breaker.State(s)))
			}
		}
		return true
	})
}

// closed reports whether every breaker is closed.
func (h *health) closed() bool {
	h.forget()
	all := true
	h.each(func(b *breaker.Breaker) { all = all && b.State() == breaker.Closed })
	return all
}

// state returns the state furthest from closed among the breakers: open,
// then half-open.
func (h *health) state() breaker.State {
	h.forget()
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
	if s >= breaker.Closed && s <= breaker.HalfOpen {
		n = h.retired[s].Load()
	}
	h.each(func(b *breaker.Breaker) { n += b.Entered(s) })
	return n
}
