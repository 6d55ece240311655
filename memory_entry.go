package tollgate

import (
	"math"
	"strings"
	"sync"
)

type memShard struct {
	mu   sync.Mutex
	keys map[string]*memEntry
	_    [48]byte // keeps neighbouring shard locks off one cache line
}

// memEntry holds the buckets and windows of one key, one per plan it was
// charged to.
type memEntry struct {
	buckets []memBucket
	seen    int64 // µs: the last decision on the key, denials and reads included
}

// memBucket is the state of one plan: its bucket, or its window when the
// plan is a window plan.
type memBucket struct {
	plan Plan
	TokenBucket
	win *window
	ver bucketVersion // of versioned plans (Plan.Version)
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
		if b.win == nil {
			return b.ver.inherit(b.TokenBucket, p, now)
		}
		return fromWindow(b.win, b.plan.Capacity, p, now)
	}
	return fullBucket(*p, now)
}

// bringBack writes back b, plan p's bucket as e.bucket reads it, refilled
// to now, if its stamp is too far ahead (TokenBucket.Refill): a decision
// that is not allowed writes nothing else, and the stamp must not stay out
// of reach of a clock that only catches up with it. e may be nil: its
// buckets read as full, never too far ahead.
func (e *memEntry) bringBack(p *Plan, b TokenBucket, now int64) {
	if b.tooFarAhead(p, now) {
		e.store(p, b.refill(p, now))
	}
}

// window returns the stored window of plan p, or nil, which counts
// nothing, if there is none. A window kept for a plan of another shape
// reads as carry makes it, and a bucket kept for a plan of the name as
// fromBucket makes it, as the script reads them.
func (e *memEntry) window(p *Plan, now int64) *window {
	b := e.find(p)
	switch {
	case b == nil:
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
		case eb.win != nil:
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
		if b.win != nil {
			at = max(at, b.win.emptyAt())
		} else {
			at = max(at, b.FullAt(b.plan, now)+b.ver.fence(&b.plan))
		}
	}
	return at
}

// entry inserts an empty entry for key, with room for n plans, and
// returns it. At the bound it reuses the entry of the key it evicts, so
// that the key's copy is the only allocation. Requires s.mu.
func (s *memShard) entry(key string, n, perCap int, now int64) *memEntry {
	var e *memEntry
	if len(s.keys) >= perCap {
		e = s.evict(now)
	}
	if e == nil {
		e = &memEntry{buckets: make([]memBucket, 0, n)}
	} else {
		clear(e.buckets) // the evicted key's windows and plans go with it
		e.buckets = e.buckets[:0]
	}
	e.seen = now
	s.keys[strings.Clone(key)] = e
	return e
}

// evict drops a key to make room, and returns its entry, or nil if the
// shard is empty: the first full key of a sample of evictSample, which
// gives nothing back, or else the one that would get back the fewest
// tokens, per µs it has been away, if it returned after as long again.
// Requires s.mu.
func (s *memShard) evict(now int64) *memEntry {
	examined := 0
	var victim string
	var ve *memEntry
	victimHarm := math.Inf(1)
	for k, e := range s.keys {
		if examined == evictSample {
			break
		}
		examined++
		at := e.fullAt(now)
		if at <= now {
			victim, ve = k, e
			break
		}
		// What it would get back if it returned after as long as it has
		// been away, per µs away: a key seen once long ago is a better
		// victim than a drained key that keeps asking.
		away := max(now-e.seen, 0) // its last decision may have read the clock after ours
		if harm := float64(at-now-away) / float64(away+1); harm < victimHarm {
			victim, ve, victimHarm = k, e, harm
		}
	}
	if ve != nil {
		delete(s.keys, victim)
	}
	return ve
}
