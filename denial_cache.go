package tollgate

import (
	"slices"
	"strings"
	"sync"
	"time"
)

// DefaultDenialCacheKeys is the default bound on the keys whose denials a
// Limiter remembers, for stores other than MemoryStore.
const DefaultDenialCacheKeys = 10_000

// denialCache remembers denials until the request could pass, so a key
// under attack costs the store one round trip per refill instead of one per
// request. A remembered denial is exact: before its time the store would
// deny the same request too, since buckets only gain tokens by refilling. Only a Reset can make it stale: Limiter.Reset drops
// the key's entries; a Reset by another instance is seen once the entry
// ends, within the RetryAfter the store gave. Plans never change within a
// Limiter. It is safe for concurrent use.
type denialCache struct {
	max   int
	epoch time.Time // the cache's monotonic clock starts here

	mu       sync.Mutex
	keys     map[string][]denial // by caller's key
	forgotAt int64               // when forget last ran, on the cache's clock
}

// denial is one remembered denial of the plans named in plans.
type denial struct {
	plans string // the plan names asked, joined by planSep
	cost  int64  // the cost asked
	until int64  // ns on the cache's clock: the request could pass then
	res   Result // the store's answer; RetryAfter and ResetAfter as of at
	at    int64  // ns on the cache's clock when the store was asked
}

// planSep cannot appear in a plan name, so joined names are unambiguous.
const planSep = ","

func newDenialCache(max int) *denialCache {
	return &denialCache{max: max, epoch: time.Now(), keys: make(map[string][]denial)}
}

func (c *denialCache) now() int64 { return int64(time.Since(c.epoch)) }

// planKey names the plans of a request. One name, the common case, costs
// nothing.
func planKey(names []string) string {
	if len(names) == 1 {
		return names[0]
	}
	return strings.Join(names, planSep)
}

// get returns the remembered denial of a request, with its waits brought
// up to date, and whether there is one. Only the same plans and cost
// match: a costlier request would wait longer, and a cheaper one may pass.
func (c *denialCache) get(key, plans string, cost int64) (Result, bool) {
	return c.getAt(key, plans, cost, c.now())
}

// getAt is get at now, a reading of the cache's clock: a Limiter reads it
// once per decision, for getAt and, on a miss, as the time it asked the
// store, since a clock read costs as much as the lookup.
func (c *denialCache) getAt(key, plans string, cost int64, now int64) (Result, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, d := range c.keys[key] {
		if d.plans == plans && d.cost == cost && now < d.until {
			r := d.res
			elapsed := time.Duration(now - d.at)
			r.RetryAfter = time.Duration(d.until - now)
			r.ResetAfter = max(0, r.ResetAfter-elapsed)
			if r.Plans != nil {
				r.Plans = slices.Clone(r.Plans)
				for i := range r.Plans {
					r.Plans[i].RetryAfter = max(0, r.Plans[i].RetryAfter-elapsed)
					r.Plans[i].ResetAfter = max(0, r.Plans[i].ResetAfter-elapsed)
				}
			}
			return r, true
		}
	}
	return Result{}, false
}

// maxDenialsPerKey bounds the denials remembered for one key, whatever
// costs and plan chains its requests ask for.
const maxDenialsPerKey = 4

// put remembers a denial the store gave to a request sent at asked. The
// store's clock read its TIME between asked and now, so counting RetryAfter
// from asked ends the denial no later than the store would: the round trip
// must not delay admissions. A denial asked before the key's last forget
// may predate a Reset, and is not remembered.
func (c *denialCache) put(key, plans string, cost int64, r Result, asked int64) {
	now := c.now()
	r.Plans = slices.Clone(r.Plans) // the caller owns its Result
	d := denial{plans: plans, cost: cost, until: asked + int64(r.RetryAfter), res: r, at: asked}
	c.mu.Lock()
	defer c.mu.Unlock()
	if asked <= c.forgotAt {
		return
	}
	list, ok := c.keys[key]
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
		if len(list) >= maxDenialsPerKey && (slot < 0 || list[i].until < list[slot].until) {
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
func (c *denialCache) evict(now int64) {
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

func allEnded(list []denial, now int64) bool {
	for _, d := range list {
		if d.until > now {
			return false
		}
	}
	return true
}

// forget drops every remembered denial of key, and refuses denials of
// requests sent before now, which may predate the Reset that forgets.
func (c *denialCache) forget(key string) {
	c.mu.Lock()
	delete(c.keys, key)
	c.forgotAt = c.now()
	c.mu.Unlock()
}
