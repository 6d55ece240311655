package tollgate

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"
)

// resetMarks remembers which keys a Limiter reset, in order with the
// reservations it took, for as long as a hold may be settled, so that a
// settlement can tell whether its key was reset since its reservation was
// taken: a refund would give back tokens to a bucket that Reset filled
// without them, and overfill it once tokens were taken after the Reset.
// Its memory is bounded: with more than maxResetMarks keys reset within a
// hold's TTL, it forgets them all and voids the refunds of every
// reservation taken before, which under-admits and never over-admits. The
// zero value is ready; it is safe for concurrent use.
type resetMarks struct {
	seq atomic.Uint64 // counts Resets; a reservation notes it when taken

	mu     sync.Mutex
	keys   map[string]resetMark // each key's latest Reset, while a hold taken before it may be settled
	forgot uint64               // seq when keys was last cleared

	// orders puts each key's Resets and settlements in one order (order):
	// a settlement reads its key's lock from its look at the marks until
	// its refund reached the store, a Reset writes it from the stores'
	// reset until it is counted, so that no refund lands on a bucket Reset
	// filled after the settlement found no Reset.
	orders [resetOrders]sync.RWMutex
}

// resetOrders is how many locks resetMarks.order spreads keys over.
const resetOrders = 64

// orderSeed seeds the hash that spreads keys over resetMarks' locks.
var orderSeed = maphash.MakeSeed()

// order returns the lock that orders key's Resets and settlements: one of
// resetOrders, by a hash of key.
func (m *resetMarks) order(key string) *sync.RWMutex {
	return &m.orders[maphash.String(orderSeed, key)%resetOrders]
}

// resetMark is a key's latest Reset: seq after it, and when it was counted.
type resetMark struct {
	seq uint64
	at  time.Time
}

// maxResetMarks is how many keys' Resets resetMarks keeps before it
// forgets the older ones.
const maxResetMarks = 1 << 16

// taken returns the mark a reservation notes when it is taken.
func (m *resetMarks) taken() uint64 { return m.seq.Load() }

// reset counts a Reset of key at now; Resets older than keep, the longest
// a hold may be settled, are forgotten when room is needed.
func (m *resetMarks) reset(key string, now time.Time, keep time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.keys) >= maxResetMarks {
		m.prune(now.Add(-keep))
	}
	if m.keys == nil {
		m.keys = make(map[string]resetMark)
	}
	m.keys[key] = resetMark{seq: m.seq.Add(1), at: now}
}

// prune forgets the Resets counted before since. If more than half of
// maxResetMarks remain, it forgets them all, so that it scans the keys
// once per maxResetMarks/2 Resets at most.
func (m *resetMarks) prune(since time.Time) {
	for k, r := range m.keys {
		if r.at.Before(since) {
			delete(m.keys, k)
		}
	}
	if len(m.keys) > maxResetMarks/2 {
		m.keys, m.forgot = nil, m.seq.Load()
	}
}

// since reports whether key was reset after a reservation that noted
// mark was taken, or may have been: a Reset that was forgotten counts.
func (m *resetMarks) since(key string, mark uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.keys[key]
	return mark < m.forgot || ok && r.seq > mark
}

// longestHold returns the longest a hold the Limiter took may still be
// settled: its hold TTL, or its leases' holds' if they live longer.
func (l *Limiter) longestHold() time.Duration {
	if l.leases == nil {
		return l.holdTTL
	}
	return max(l.holdTTL, l.leases.holdTTL())
}
