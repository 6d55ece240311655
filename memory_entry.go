package tollgate

import (
	"strings"
	"sync"
)

// memEntry holds the buckets, windows and permits of one key, one per plan it was
// charged to, under its own lock. Its key changes under the shard's lock
// as well, so that a lookup under either lock may read it.
//
// A decision on a key of one plan writes one cache line: the lock, seen
// and the bucket in one, which is the storage of buckets until a second
// plan needs more. Its size is a multiple of 64 bytes (a test pins it),
// so that the allocator places every entry at the start of a cache line.
type memEntry struct {
	mu      sync.Mutex
	seen    int64 // µs: the last decision on the key, denials, reads and Resets included
	one     [1]memBucket
	buckets []memBucket
	key     string // "" once the key left its shard: a decision that found the entry looks again
}

// memBucket is the state of one plan: its bucket, or its window when the
// plan is a window plan. The bucket comes first, on the cache line of its
// entry's lock when it is the entry's first.
type memBucket struct {
	TokenBucket
	plan Plan
	win  *window
	sem  *semaphore    // of concurrency plans (Plan.Concurrency)
	ver  bucketVersion // of versioned plans (Plan.Version)
}

// find returns the stored state of plan p's name, or nil. e may be nil: a
// key without state.
func (e *memEntry) find(p *Plan) *memBucket {
	if e != nil {
		for i := range e.buckets {
			if e.buckets[i].plan.Name == p.Name {
				return &e.buckets[i]
			}
		}
	}
	return nil
}

// bucket returns the stored bucket of plan p, or a full one at now if
// there is none. A window kept for a plan of the name reads as fromWindow
// makes it, as the script reads it.
func (e *memEntry) bucket(p *Plan, now int64) TokenBucket {
	if b := e.find(p); b != nil {
		switch {
		case b.sem != nil: // holds no tokens, as the script reads another type
			return fullBucket(*p, now)
		case b.win != nil:
			return fromWindow(b.win, b.plan.Capacity, p, now)
		case p.Version > b.ver.pv:
			return b.ver.inherit(b.TokenBucket, p, now)
		}
		return b.TokenBucket // what inherit returns, without the call
	}
	return fullBucket(*p, now)
}

// bringBack writes back b, plan p's bucket as e.bucket reads it, refilled
// to now, if its stamp is too far ahead (TokenBucket.Refill), or as read
// if it was read from a window of the name ahead of now: a decision that
// is not allowed writes nothing else, and neither must stay out of reach
// of a clock that only catches up with it. e may be nil: its buckets read
// as full, never too far ahead.
func (e *memEntry) bringBack(p *Plan, b TokenBucket, now int64) {
	switch kept := e.find(p); {
	case kept != nil && kept.win.ahead(now): // a window of the name, ahead, reads as b
		e.store(p, b)
	case b.tooFarAhead(p, now):
		e.store(p, b.refill(p, now))
	}
}

// bringBackWindow writes back plan p's window as e.window reads it, if the
// window kept for p's name is ahead of now: its counts move into now's
// sub-window, where they leave one window later, as a decision that is
// not allowed writes nothing else. e may be nil: a key without state.
func (e *memEntry) bringBackWindow(p *Plan, now int64) {
	if eb := e.find(p); eb != nil && eb.win.ahead(now) {
		e.storeWindow(p, now).add(p, now, 0, 0)
	}
}

// window returns the stored window of plan p, or nil, which counts
// nothing, if there is none. A window kept for a plan of another shape
// reads as carry makes it, and a bucket kept for a plan of the name as
// fromBucket makes it, as the script reads them.
func (e *memEntry) window(p *Plan, now int64) *window {
	b := e.find(p)
	switch {
	case b == nil || b.sem != nil:
		return nil
	case b.win == nil:
		return fromBucket(b.TokenBucket, p, now)
	case sameShape(&b.plan, p):
		return b.win
	}
	return carry(b.win, b.plan.Suppress != 0, p, now)
}

// sameShape reports whether window plans a and b count in the same
// sub-windows, so that one may read the other's window.
func sameShape(a, b *Plan) bool {
	if (a.Suppress != 0) != (b.Suppress != 0) || a.slots() != b.slots() {
		return false
	}
	return a.Window == b.Window || a.width() == b.width() // the same window, or rounded alike
}

// store sets the bucket of plan p.
func (e *memEntry) store(p *Plan, b TokenBucket) {
	for i := range e.buckets {
		switch eb := &e.buckets[i]; {
		case eb.plan.Name != p.Name:
		case eb.win != nil || eb.sem != nil:
			*eb = memBucket{plan: *p, TokenBucket: b, ver: bucketVersion{}.written(p)}
			return
		case eb.plan.Capacity != p.Capacity || eb.plan.Rate != p.Rate:
			// Another Limiter with other plans of that name shares the store.
			*eb = memBucket{plan: *p, TokenBucket: b, ver: eb.ver.written(p)}
			return
		default: // no pointer written, no write barrier
			eb.TokenBucket = b
			if p.Version != 0 {
				eb.ver = eb.ver.written(p)
			}
			return
		}
	}
	e.buckets = append(e.buckets, memBucket{plan: *p, TokenBucket: b, ver: bucketVersion{}.written(p)})
}

// storeWindow returns plan p's window to write in: new if there is none,
// carried over if it was kept for a plan of another shape, and made from
// the bucket if a plan of the name kept one.
func (e *memEntry) storeWindow(p *Plan, now int64) *window {
	eb := e.find(p)
	switch {
	case eb == nil:
		e.buckets = append(e.buckets, memBucket{plan: *p, win: &window{}})
		return e.buckets[len(e.buckets)-1].win
	case eb.sem != nil:
		*eb = memBucket{plan: *p, win: &window{}}
	case eb.win == nil:
		*eb = memBucket{plan: *p, win: fromBucket(eb.TokenBucket, p, now)}
	case !sameShape(&eb.plan, p):
		*eb = memBucket{plan: *p, win: carry(eb.win, eb.plan.Suppress != 0, p, now)}
	case eb.plan.Capacity != p.Capacity || eb.plan.Suppress != p.Suppress:
		eb.plan = *p
	}
	return eb.win
}

// fullAt returns when every bucket of the entry is full again, and every
// window counts nothing: when the store may forget it for free. A bucket
// that holds a version counts one fence longer, as Redis keeps it.
func (e *memEntry) fullAt(now int64) int64 {
	at := int64(0)
	for _, b := range e.buckets {
		switch {
		case b.sem != nil:
			at = max(at, b.sem.endsAt())
		case b.win != nil:
			at = max(at, b.win.emptyAt())
		default:
			at = max(at, b.FullAt(b.plan, now)+b.ver.fence(&b.plan))
		}
	}
	return at
}

// semaphore returns the permits of concurrency plan p, or nil, which
// holds none, if there are none: state of another kind kept for a plan of
// the name holds no permits, as the script reads it. e may be nil.
func (e *memEntry) semaphore(p *Plan) *semaphore {
	if b := e.find(p); b != nil {
		return b.sem
	}
	return nil
}

// storeSemaphore returns concurrency plan p's permits to add to: new if
// there are none, replacing state of another kind kept for a plan of the
// name.
func (e *memEntry) storeSemaphore(p *Plan) *semaphore {
	eb := e.find(p)
	switch {
	case eb == nil:
		e.buckets = append(e.buckets, memBucket{plan: *p, sem: &semaphore{}})
		return e.buckets[len(e.buckets)-1].sem
	case eb.sem == nil:
		*eb = memBucket{plan: *p, sem: &semaphore{}}
	}
	return eb.sem
}

// newMemEntry returns an entry with room for n plans, locked.
func newMemEntry(n int) *memEntry {
	e := &memEntry{}
	e.buckets = e.one[:0]
	if n > len(e.one) {
		e.buckets = make([]memBucket, 0, n)
	}
	e.mu.Lock()
	return e
}

// claim makes e, locked, the entry of key, without buckets, last seen at
// now: an evicted key's windows and plans go with it. Requires the
// shard's lock.
func (e *memEntry) claim(key string, now int64) {
	clear(e.one[:])
	clear(e.buckets)
	e.buckets = e.buckets[:0]
	e.key = strings.Clone(key)
	e.seen = now
}
