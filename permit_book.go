package tollgate

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
)

// permitBook keeps the permits a Limiter granted and has not released,
// by key, and renews their leases: every third of the lease, one call
// per key and store for all the permits held there, the calls to a store
// that can fail each on a goroutine of its own, so that a key whose node
// hangs holds up no other. It starts its goroutine at the first permit,
// and stops it when it holds none, or at close. It is safe for concurrent
// use. Locks, in order: closing, a Permit's mu, fallback, mu.
type permitBook struct {
	l     *Limiter
	lease time.Duration

	closing  sync.Mutex // one close at a time, so that each returns once all is released
	fallback sync.Mutex // a fallback's Acquire, and a move of the fallback's permits into the store

	mu    sync.Mutex
	byKey map[string][]*Permit
	stop  chan struct{} // closed to stop the goroutine that renews; nil while none runs
	done  chan struct{} // closed when it has stopped
}

// add keeps p, granted, to renew it.
func (b *permitBook) add(p *Permit) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.byKey == nil {
		b.byKey = make(map[string][]*Permit)
	}
	b.byKey[p.key] = append(b.byKey[p.key], p)
	if b.stop == nil {
		b.stop, b.done = make(chan struct{}), make(chan struct{})
		go b.run(b.stop, b.done)
	}
}

// remove stops renewing p.
func (b *permitBook) remove(p *Permit) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ps := b.byKey[p.key]
	for i, q := range ps {
		if q == p {
			ps[i] = ps[len(ps)-1]
			ps[len(ps)-1] = nil
			ps = ps[:len(ps)-1]
			break
		}
	}
	if len(ps) == 0 {
		delete(b.byKey, p.key)
		return
	}
	b.byKey[p.key] = ps
}

// heldFrom returns how many permits of plan name on key this Limiter
// holds from store s.
func (b *permitBook) heldFrom(key, name string, s Store) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	var n int64
	for _, p := range b.byKey[key] {
		for i := range p.plans {
			if p.grant.store == s && p.plans[i].Name == name {
				n += p.n
			}
		}
	}
	return n
}

// run renews every interval until stop is closed, or the book holds no
// permit, then closes done.
func (b *permitBook) run(stop, done chan struct{}) {
	defer close(done)
	interval := b.lease / 3
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			b.pass(b.held(stop), stop, interval, b.lease)
			if b.idle(stop) {
				return
			}
		}
	}
}

// held returns the permits the book holds, by key; none for the goroutine
// whose stop is given once close has stopped it.
func (b *permitBook) held(stop chan struct{}) [][]*Permit {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stop != stop {
		return nil
	}
	keys := make([][]*Permit, 0, len(b.byKey))
	for _, ps := range b.byKey {
		keys = append(keys, slices.Clone(ps))
	}
	return keys
}

// idle reports whether the goroutine whose stop is given may end: the
// book holds no permit, and the next add starts another.
func (b *permitBook) idle(stop chan struct{}) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stop != stop || len(b.byKey) > 0 {
		return false
	}
	b.stop, b.done = nil, nil
	return true
}

// pass renews the permits keys holds, by key, for lease, or releases them
// for a lease of 0, all within timeout, or until stop is closed: a call
// that fails is tried again at the next pass. A store of this process is
// called inline, since it cannot hang; the calls to a store that can
// fail, and the moves of the fallback's permits into the store, each on a
// goroutine of its own (a fallback that can fail renews and moves on the
// same one).
func (b *permitBook) pass(keys [][]*Permit, stop chan struct{}, timeout, lease time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	go func() { // close waits for no call of this pass
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	var wg sync.WaitGroup
	for _, ps := range keys {
		for _, g := range byStore(ps) {
			if !isLocal(g[0].grant.store) {
				wg.Go(func() {
					b.renew(ctx, g, lease)
					if lease > 0 && b.movable(ctx, g) {
						b.adopt(ctx, g, lease)
					}
				})
				continue
			}
			b.renew(ctx, g, lease)
			if lease > 0 && b.movable(ctx, g) {
				wg.Go(func() { b.adopt(ctx, g, lease) })
			}
		}
	}
	wg.Wait()
}

// movable reports whether the permits ps of one key are the fallback's,
// granted during an outage, and the store may take them: the key's
// breaker is closed again.
func (b *permitBook) movable(ctx context.Context, ps []*Permit) bool {
	l := b.l
	return l.health != nil && ps[0].grant.store == l.fallback &&
		l.health.forKey(ctx, ps[0].key, ps[0].plans).b.State() == breaker.Closed
}

// adopt moves the permits ps of one key, which the fallback granted and
// has just renewed, into the store, so that it counts them while their
// holders work: added there for lease, whatever its count, then released
// in the fallback, and renewed and released in the store from then on.
// No Release waits for the store's call: a permit released or lost while
// it ran stays the fallback's, and its copy is released in the store. If
// the store fails, all stay until the next pass, and a copy the call may
// have added ends with its lease.
func (b *permitBook) adopt(ctx context.Context, ps []*Permit, lease time.Duration) {
	l := b.l
	held, _ := stillHeld(ps, false)
	if len(held) == 0 {
		return
	}
	o := opOf(held, lease)
	o.adopt = true
	if _, err := l.store.(permitStore).permits(ctx, o); err != nil {
		return // a copy the call may have added ends with its lease
	}
	// Released or lost meanwhile: the copy added is released in the store.
	moved, gone := stillHeld(held, true)
	if len(moved) > 0 {
		b.move(ctx, moved)
	}
	unlock(moved)
	if len(gone) > 0 {
		_, _ = l.store.(permitStore).permits(ctx, opOf(gone, 0))
	}
}

// move releases the permits ps, locked, in the fallback, and makes the
// store theirs, while a fallback's Acquire waits: it sees them in one
// store or the other.
func (b *permitBook) move(ctx context.Context, ps []*Permit) {
	l := b.l
	b.fallback.Lock()
	defer b.fallback.Unlock()
	// A fallback that can fail (WithFallback) and does keeps its copy
	// until its lease ends: it counts a permit too many meanwhile.
	_, _ = l.fallback.(permitStore).permits(ctx, opOf(ps, 0))
	b.mu.Lock() // heldFrom reads a permit's store under the book's lock
	for _, p := range ps {
		p.grant.store = l.store
	}
	b.mu.Unlock()
	l.stats.permits.adopted.Add(uint64(len(ps)))
}

// stillHeld splits ps into those neither released nor lost, and the
// others, in order. With keep, it leaves the first locked, so that no
// Release reads their store until unlock.
func stillHeld(ps []*Permit, keep bool) (held, gone []*Permit) {
	for _, p := range ps {
		p.mu.Lock()
		if p.released || p.lost {
			p.mu.Unlock()
			gone = append(gone, p)
			continue
		}
		held = append(held, p)
		if !keep {
			p.mu.Unlock()
		}
	}
	return held, gone
}

// unlock unlocks the permits ps.
func unlock(ps []*Permit) {
	for _, p := range ps {
		p.mu.Unlock()
	}
}

// renew renews, or releases for a lease of 0, the permits ps of one key
// granted by one store, in one call, and stops renewing those the store
// found lost. A call that fails is tried again at the next interval.
func (b *permitBook) renew(ctx context.Context, ps []*Permit, lease time.Duration) {
	st := &b.l.stats.permits
	reply, err := ps[0].grant.store.(permitStore).permits(ctx, opOf(ps, lease))
	if err != nil {
		if lease == 0 {
			st.unreleased.Add(uint64(len(ps)))
		}
		return
	}
	st.reclaimed.Add(uint64(reply.reclaimed))
	for h, p := range ps {
		switch {
		case lease == 0 && reply.live[h]:
			st.released.Add(1)
		case lease == 0:
			st.lost.Add(1)
		case !reply.live[h] && p.markLost():
			b.remove(p)
			st.lost.Add(1)
		}
	}
}

// opOf returns the permitOp that renews the permits ps of one key for
// lease, or releases them for a lease of 0.
func opOf(ps []*Permit, lease time.Duration) permitOp {
	o := permitOp{key: ps[0].key, lease: lease, holders: make([]permitHolder, len(ps))}
	for h, p := range ps {
		o.holders[h] = permitHolder{id: p.grant.id, n: p.n}
		for _, pl := range p.plans {
			i := planIndex(&o.plans, pl)
			o.holders[h].mask |= 1 << i
		}
	}
	return o
}

// planIndex returns the index of the plan of p's name in *plans, which it
// appends p to if it has none.
func planIndex(plans *[]Plan, p Plan) int {
	for i := range *plans {
		if (*plans)[i].Name == p.Name {
			return i
		}
	}
	*plans = append(*plans, p)
	return len(*plans) - 1
}

// byStore splits the permits ps of one key by the store that granted
// them, and each store's into groups holding at most maxChain plans in
// all: a permitOp names a holder's plans by bits of a mask, which
// permit.lua reads as a double, exact to 53 bits.
func byStore(ps []*Permit) [][]*Permit {
	var groups [][]*Permit
	var plans [][]Plan // of each group
	for _, p := range ps {
		i := 0
		for i < len(groups) && (groups[i][0].grant.store != p.grant.store || !fits(plans[i], p.plans)) {
			i++
		}
		if i == len(groups) {
			groups, plans = append(groups, nil), append(plans, nil)
		}
		groups[i] = append(groups[i], p)
		for _, pl := range p.plans {
			planIndex(&plans[i], pl)
		}
	}
	return groups
}

// fits reports whether the plans of a group, with more added, are at
// most maxChain.
func fits(group, more []Plan) bool {
	n := len(group)
	for _, p := range more {
		if !slices.ContainsFunc(group, func(q Plan) bool { return q.Name == p.Name }) {
			n++
		}
	}
	return n <= maxChain
}

// close stops the renewals and releases the permits still held, within
// detachTimeout in all. A permit granted after it is renewed again,
// until the next close.
func (b *permitBook) close() {
	b.closing.Lock()
	defer b.closing.Unlock()
	b.mu.Lock()
	keys := make([][]*Permit, 0, len(b.byKey))
	for _, ps := range b.byKey {
		keys = append(keys, ps) // the book's no more: remove finds none of them
	}
	stop, done := b.stop, b.done
	b.stop, b.done, b.byKey = nil, nil, nil
	b.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
	for i, ps := range keys {
		keys[i] = slices.DeleteFunc(ps, func(p *Permit) bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.released || p.lost { // released meanwhile by its holder, or found lost
				return true
			}
			p.released = true
			return false
		})
	}
	b.pass(keys, nil, detachTimeout, 0)
}

// lessHeld returns plans, an Acquire's plans on key, with the capacity of
// each concurrency plan lowered by the permits of it that this Limiter
// holds from store from, which the store deciding does not count: their
// holders still work, and it must not grant their slots again. It
// returns plans itself if from holds none of them.
func (l *Limiter) lessHeld(plans []Plan, key string, from Store) []Plan {
	var out []Plan
	for i := range plans {
		if !plans[i].Concurrency {
			continue
		}
		if n := l.book.heldFrom(key, plans[i].Name, from); n > 0 {
			if out == nil {
				out = slices.Clone(plans)
			}
			out[i].Capacity = max(out[i].Capacity-n, 0)
		}
	}
	if out == nil {
		return plans
	}
	return out
}
