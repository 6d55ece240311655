package tollgate

import (
	"context"
	"fmt"
	"hash/maphash"
	"strings"
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

	mu   sync.Mutex
	book markBook // each key's latest Reset, as seq after it, while a hold taken before it may be settled

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

// marksEpoch is the origin of the clock resetMarks keeps its Resets'
// times on: monotonic, as time.Now reads it.
var marksEpoch = time.Now()

// maxResetMarks is how many keys' Resets resetMarks keeps before it
// forgets the older ones, and how many a MemoryStore keeps in all.
const maxResetMarks = 1 << 16

// taken returns the mark a reservation notes when it is taken.
func (m *resetMarks) taken() uint64 { return m.seq.Load() }

// reset counts a Reset of key at now; Resets older than keep, the longest
// a hold may be settled, are forgotten when room is needed.
func (m *resetMarks) reset(key string, now time.Time, keep time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	at := int64(now.Sub(marksEpoch))
	m.book.set(key, bookMark{mark: int64(m.seq.Add(1)), until: at + int64(keep)}, at, maxResetMarks)
}

// since reports whether key was reset after a reservation that noted
// mark was taken, or may have been: a Reset that was forgotten counts.
func (m *resetMarks) since(key string, mark uint64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	since, _ := m.book.since(key, int64(mark)+1) // the count of the first Reset after it
	return since
}

// markBook keeps each key's latest mark, a count or a time that only
// grows, for as long as it may void a refund. Its memory is bounded by
// the limit its caller gives: with that many keys marked, the marks past
// their time go, and if more than half the limit is left, all go, and
// the largest stands in for them, so that every mark up to it still
// counts: that voids more refunds, never fewer. The zero value is empty;
// its caller locks it.
type markBook struct {
	marks  map[string]bookMark
	forgot int64 // the largest mark forgotten before its time
}

// bookMark is a key's latest mark, kept until until at least, on the
// clock of its caller's now.
type bookMark struct{ mark, until int64 }

// set marks key with m at now, or with the later mark and the later
// until of m and the key's mark, if it has one. With limit keys marked,
// it forgets marks first (prune).
func (b *markBook) set(key string, m bookMark, now int64, limit int) {
	if len(b.marks) >= limit {
		b.prune(now, limit)
	}
	if b.marks == nil {
		b.marks = make(map[string]bookMark)
	}
	if old, ok := b.marks[key]; ok {
		m = bookMark{mark: max(m.mark, old.mark), until: max(m.until, old.until)}
	} else {
		key = strings.Clone(key) // not the caller's buffer
	}
	b.marks[key] = m
}

// prune forgets the marks kept until before now. If more than half of
// limit remain, it forgets them all, and keeps the largest, so that it
// scans the keys once per limit/2 marks set at most.
func (b *markBook) prune(now int64, limit int) {
	for k, m := range b.marks {
		if m.until < now {
			delete(b.marks, k)
		}
	}
	if len(b.marks) > limit/2 {
		for _, m := range b.marks {
			b.forgot = max(b.forgot, m.mark)
		}
		b.marks = nil
	}
}

// since reports whether key was marked at from or after, or may have
// been: a mark that was forgotten counts; and whether key has a mark.
func (b *markBook) since(key string, from int64) (since, marked bool) {
	m, ok := b.marks[key]
	return from <= b.forgot || ok && m.mark >= from, ok
}

// longestHold returns the longest a hold the Limiter took may still be
// settled: its hold TTL, or its leases' holds' if they live longer.
func (l *Limiter) longestHold() time.Duration {
	if l.leases == nil {
		return l.holdTTL
	}
	return max(l.holdTTL, l.leases.holdTTL())
}

// resetStores resets key's plans in the fallback store and the store, and
// counts the Reset (resetMarks), with no settlement of key running from
// the stores' reset to its count.
func (l *Limiter) resetStores(ctx context.Context, key string, plans []Plan) error {
	order := l.resets.order(key)
	order.Lock()
	defer order.Unlock()
	// Counted once the stores may have reset: a reservation whose mark
	// was read before then is refunded nothing.
	keep := l.longestHold()
	defer func() { l.resets.reset(key, time.Now(), keep) }()
	if l.fallback != nil {
		if err := resetHolds(ctx, l.fallback, key, plans, keep); err != nil {
			return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
		}
	}
	if err := resetHolds(ctx, l.store, key, plans, keep); err != nil {
		if isCallerError(err) || ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	return nil
}
