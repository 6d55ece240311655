// Package denialcache remembers denials until the request they denied could
// pass, so that a key under attack costs the store one call per refill
// instead of one per request. It stores any value and knows nothing of
// buckets: the caller says until when each denial holds.
//
// A request names the plans it asked as one string: items joined by ',',
// each a plan's name, '#' and its parameters (an item without '#' is a
// name alone). Two requests of a key conflict when they name a plan of one
// name with other parameters: the plan changed, and the bucket may have
// filled under the other parameters, so a request under one forgets the
// key's denials under the other, and refuses the other's denials still in
// flight.
package denialcache

import (
	"hash/maphash"
	"math"
	"math/bits"
	"strings"
	"sync"
	"time"
)

// Cache remembers denials of requests, each named by a key, the plans asked
// (joined into one string) and a cost. It is safe for concurrent use.
type Cache[V any] struct {
	max   int
	epoch time.Time // the cache's monotonic clock starts here

	seed maphash.Seed

	mu       sync.Mutex
	keys     map[string][]denial[V] // by caller's key
	forgotAt int64                  // when Forget last ran, on the cache's clock
	asks     []ask                  // by hash of key and plan name; a power of two
}

// ask is the last request the cache saw of the keys and plan names that
// hash to it: which plan item it named, and when it last saw a request
// name another item than the one before (changed), so that a denial asked
// before then, which may predate a request under another plan of its
// name, is refused. Keys and names that share a slot only make the cache
// refuse more: a denial not remembered costs one store call.
type ask struct {
	item    uint64 // hash of the key and the plan item
	changed int64  // on the cache's clock, after every last before it
	last    int64  // the latest time a request of the slot was sent, or changed
}

// Slots of asks: enough that few requests of other keys and names share
// one while a request is in flight, at 24 bytes each.
const (
	minAsks = 64
	maxAsks = 4096
)

type denial[V any] struct {
	plans string // the plan names asked
	cost  int64  // the cost asked
	until int64  // ns on the cache's clock: the request could pass then
	at    int64  // ns on the cache's clock when the store was asked
	val   V
}

// Keys a full cache examines to find room: keys whose denials have all
// ended go, and if none has, one of the sample.
const evictSample = 16

// MaxPerKey bounds the denials remembered for one key, whatever costs and
// plan chains its requests ask for.
const MaxPerKey = 4

// New returns a Cache that holds at most max keys, whose clock counts from
// epoch: a caller that shares the epoch can read the time once for its own
// use and the cache's.
func New[V any](max int, epoch time.Time) *Cache[V] {
	// forgotAt starts before any reading of the clock, so that a denial
	// asked at the cache's first instant is kept.
	return &Cache[V]{max: max, epoch: epoch, keys: make(map[string][]denial[V]), forgotAt: -1,
		seed: maphash.MakeSeed(), asks: make([]ask, askSlots(max))}
}

// askSlots returns the number of slots of asks for a cache of keys keys:
// the power of two at or above keys, within minAsks and maxAsks.
func askSlots(keys int) int {
	n := 1 << bits.Len(uint(max(keys-1, 0)))
	return min(max(n, minAsks), maxAsks)
}

// Now reads the cache's clock: monotonic nanoseconds since its epoch.
func (c *Cache[V]) Now() int64 { return int64(time.Since(c.epoch)) }

// Get looks up the remembered denial of a request that still holds at
// now, a reading of Now. If there is one, it copies its value into *into
// and returns when the store was asked for it and until when it holds.
// Only the same plans and cost match: a costlier request would wait
// longer, and a cheaper one may pass. A miss copies nothing: the value
// may be large, and misses are the common case. It forgets the key's
// denials under plans that conflict with plans, as Supersede does, and
// notes that a request under plans was sent at now: a Put of a conflicting
// denial asked before it is refused.
func (c *Cache[V]) Get(key, plans string, cost, now int64, into *V) (asked, until int64, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.note(key, plans, now)
	list := c.supersede(key, plans)
	for i := range list {
		d := &list[i]
		if d.plans == plans && d.cost == cost && now < d.until {
			*into = d.val
			return d.at, d.until, true
		}
	}
	return 0, 0, false
}

// Put remembers a denial that holds until until, of a request sent at
// asked (both readings of Now), and forgets the key's denials under plans
// that conflict with plans. A denial asked before the last Forget or
// ForgetAll may predate a Reset or a change of plans, and one asked before
// a request of its key under a conflicting plan (Get, Supersede) may
// predate a fill under that plan: neither is remembered. The request
// denied must have been looked up (Get) at asked.
func (c *Cache[V]) Put(key, plans string, cost int64, val V, asked, until int64) {
	now := c.Now()
	d := denial[V]{plans: plans, cost: cost, until: until, at: asked, val: val}
	c.mu.Lock()
	defer c.mu.Unlock()
	if asked <= c.forgotAt || c.changedAfter(key, plans, asked) {
		return
	}
	list, ok := c.keys[key]
	c.supersede(key, plans)
	if !ok && len(c.keys) >= c.max {
		c.evict(now)
	}
	// Replace the same request's entry, or an ended one, or at the bound
	// the one that ends first.
	slot := -1
	for i := range list {
		if list[i].plans == plans && list[i].cost == cost || list[i].until <= now {
			slot = i
			break
		}
		if len(list) >= MaxPerKey && (slot < 0 || list[i].until < list[slot].until) {
			slot = i
		}
	}
	if slot >= 0 {
		list[slot] = d
		return
	}
	// A fresh key string: assigning to an existing string key replaces the
	// map's copy, and the caller's may pin a larger buffer.
	c.keys[strings.Clone(key)] = append(list, d)
}

// evict drops the keys whose denials have all ended among a sample and,
// if that freed nothing, one key of the sample. Requires c.mu.
func (c *Cache[V]) evict(now int64) {
	examined := 0
	victim, found := "", false
	for k, list := range c.keys {
		if examined == evictSample {
			break
		}
		examined++
		if allEnded(list, now) {
			delete(c.keys, k)
			continue
		}
		victim, found = k, true
	}
	if found && len(c.keys) >= c.max {
		delete(c.keys, victim)
	}
}

func allEnded[V any](list []denial[V], now int64) bool {
	for _, d := range list {
		if d.until > now {
			return false
		}
	}
	return true
}

// Forget drops every remembered denial of key, and refuses denials of
// requests sent before now, which may predate the Reset that forgets.
func (c *Cache[V]) Forget(key string) {
	c.mu.Lock()
	delete(c.keys, key)
	c.forgotAt = c.Now()
	c.mu.Unlock()
}

// ForgetAll drops every remembered denial, and refuses denials of
// requests sent before now, which may predate the change of plans that
// forgets.
func (c *Cache[V]) ForgetAll() {
	c.mu.Lock()
	c.keys = make(map[string][]denial[V])
	c.forgotAt = c.Now()
	c.mu.Unlock()
}

// Supersede forgets key's denials under plans that conflict with plans,
// and refuses those still in flight: a request under plans went to the
// store, whose answer is newer.
func (c *Cache[V]) Supersede(key, plans string) {
	now := c.Now()
	c.mu.Lock()
	c.note(key, plans, now)
	c.supersede(key, plans)
	c.mu.Unlock()
}

// note records that a request of key under plans was sent at now. A slot
// whose last request named another item changes after every time it saw,
// so that a denial asked before this request, or a request it saw before,
// is refused; its own denial is kept unless a request of the slot was
// sent at now or later. Requires c.mu.
func (c *Cache[V]) note(key, plans string, now int64) {
	k := maphash.String(c.seed, key)
	for plans != "" {
		var item string
		item, plans, _ = strings.Cut(plans, ",")
		a, id := c.askOf(k, item)
		if a.item != id {
			a.item, a.changed = id, max(now, a.last+1)
			a.last = a.changed
		}
		a.last = max(a.last, now)
	}
}

// changedAfter reports whether a slot of key's plans changed after asked:
// a request under another item of one of its plans may have been sent
// since. Requires c.mu.
func (c *Cache[V]) changedAfter(key, plans string, asked int64) bool {
	k := maphash.String(c.seed, key)
	for plans != "" {
		var item string
		item, plans, _ = strings.Cut(plans, ",")
		if a, _ := c.askOf(k, item); a.changed > asked {
			return true
		}
	}
	return false
}

// askOf returns the slot of the key whose hash is k and the plan named by
// item, and item's id in it. Requires c.mu.
func (c *Cache[V]) askOf(k uint64, item string) (*ask, uint64) {
	name := maphash.String(c.seed, nameOf(item))
	id := k ^ maphash.String(c.seed, item)
	return &c.asks[(k^name)&uint64(len(c.asks)-1)], id
}

// ended is the until of a forgotten denial: it holds at no reading of Now.
const ended = math.MinInt64

// supersede ends key's denials under plans that conflict with plans, in
// place, so that neither the map nor its key is written, and returns the
// key's denials. Requires c.mu.
func (c *Cache[V]) supersede(key, plans string) []denial[V] {
	list := c.keys[key]
	for i := range list {
		if d := &list[i]; d.until != ended && d.plans != plans && conflict(d.plans, plans) {
			*d = denial[V]{until: ended} // and drop its value, which may hold slices
		}
	}
	return list
}

// conflict reports whether plan lists a and b name a plan of one name with
// other parameters.
func conflict(a, b string) bool {
	for a != "" {
		var x string
		x, a, _ = strings.Cut(a, ",")
		for rest := b; rest != ""; {
			var y string
			y, rest, _ = strings.Cut(rest, ",")
			if x != y && nameOf(x) == nameOf(y) {
				return true
			}
		}
	}
	return false
}

// nameOf returns the plan name of an item of a plan list.
func nameOf(item string) string {
	name, _, _ := strings.Cut(item, "#")
	return name
}

// Len returns the number of keys the cache holds.
func (c *Cache[V]) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.keys)
}
