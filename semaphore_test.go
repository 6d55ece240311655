package tollgate

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
)

// The plans of the permit agreement tests: two concurrency plans and a
// bucket of 10 tokens that refills in about 3 s, so that random steps
// find each of them full, empty and between.
var (
	semInflight = Plan{Name: "inflight", Capacity: 6, Concurrency: true}
	semPool     = Plan{Name: "pool", Capacity: 9, Concurrency: true}
	// semLowered is semInflight with a capacity lowered (SetPlans, or
	// instances with other plans): its holders may hold more than it.
	semLowered = Plan{Name: "inflight", Capacity: 2, Concurrency: true}
	semBucket  = Plan{Name: "tb", Capacity: 10, Rate: 3}
)

// semChains are the chains an Acquire of the agreement tests names, in
// both orders: a concurrency plan alone, with the bucket, and with both.
var semChains = [][]Plan{
	{semInflight},
	{semLowered, semBucket},
	{semInflight, semBucket},
	{semBucket, semInflight},
	{semPool, semBucket, semInflight},
	{semInflight, semPool},
}

// permitRig feeds the same steps to a RedisStore on miniredis and to a
// MemoryStore, on one clock, at the store level (decide and permits),
// demands the same answers from both, and checks both, after every
// step, against a model of the permits and the bucket.
type permitRig struct {
	t   testing.TB
	ctx context.Context
	rs  *RedisStore
	mr  *miniredis.Miniredis
	ms  *MemoryStore
	now int64
	// ttl has miniredis's TTLs follow the clock (FastForward), so that
	// Redis deletes a key once its last lease ended; the clock then never
	// steps back, which FastForward cannot follow.
	ttl bool

	sems   map[string]map[string]permitLease // the model: by plan, by holder id
	bucket *TokenBucket                      // the model of semBucket; nil: none stored
	ns     map[string]int64                  // every holder id acquired, and its n
	ids    []string                          // the same ids, in order
	step   int
	log    []string // the steps so far, for a failure's message
}

const semKey = "k"

func newPermitRig(t testing.TB, ttl bool) *permitRig {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	r := &permitRig{t: t, ctx: context.Background(), rs: NewRedisStore(c, WithoutBatching()), mr: mr, now: t0, ttl: ttl,
		sems: map[string]map[string]permitLease{}, ns: map[string]int64{}}
	r.ms = newClockedMemoryStore(&r.now)
	mr.SetTime(time.UnixMicro(r.now))
	return r
}

// advance moves the clock by d µs; back for d < 0.
func (r *permitRig) advance(d int64) {
	r.now += d
	r.mr.SetTime(time.UnixMicro(r.now))
	if r.ttl {
		require.GreaterOrEqual(r.t, d, int64(0), "FastForward cannot step back")
		r.mr.FastForward(time.Duration(d) * time.Microsecond)
	}
	r.note("advance %d", d)
	r.check()
}

// note records step s, and counts it.
func (r *permitRig) note(format string, args ...any) {
	r.step++
	r.log = append(r.log, fmt.Sprintf("%d: "+format, append([]any{r.step}, args...)...))
}

// where names the last steps, for a failure's message.
func (r *permitRig) where() string {
	return "after steps\n  " + strings.Join(r.log[max(0, len(r.log)-12):], "\n  ")
}

// setKey returns the Redis key of concurrency plan p.
func (r *permitRig) setKey(p *Plan) string { return r.rs.Key(semKey, p.Name) }

// inRedis returns the concurrency plans among plans whose set Redis
// holds: it deletes a set once its last lease ended, and a call then
// reclaims nothing there.
func (r *permitRig) inRedis(plans []Plan) map[string]bool {
	out := map[string]bool{}
	for i := range plans {
		out[plans[i].Name] = plans[i].Concurrency && r.mr.Exists(r.setKey(&plans[i]))
	}
	return out
}

// reclaim removes from the model the permits of the concurrency plans
// among plans whose lease ended, as both stores do at the start of a
// call, and returns how many, and how many of them in the sets that
// Redis still held (inRedis).
func (r *permitRig) reclaim(plans []Plan, inRedis map[string]bool) (n, inSets int64) {
	for _, p := range plans {
		for id, h := range r.sems[p.Name] {
			if h.ends <= r.now {
				delete(r.sems[p.Name], id)
				n += h.n
				if inRedis[p.Name] {
					inSets += h.n
				}
			}
		}
	}
	return n, inSets
}

// held returns the permits of plan p the model holds.
func (r *permitRig) held(p *Plan) (n int64) {
	for _, h := range r.sems[p.Name] {
		n += h.n
	}
	return n
}

// acquire has both stores decide an Acquire of n permits for a new
// holder with a lease of lease µs, on plans, and checks the answers.
func (r *permitRig) acquire(n, lease int64, plans []Plan) {
	id := fmt.Sprintf("h%d", len(r.ids))
	r.ids, r.ns[id] = append(r.ids, id), n
	r.note("acquire %s n=%d lease=%d on %s", id, n, lease, planNames(plans))
	sets := r.inRedis(plans)
	onRedis, onMemory := r.decide(r.rs, id, n, lease, plans), r.decide(r.ms, id, n, lease, plans)

	reclaimed, inSets := r.reclaim(concurrencyOf(plans), sets)
	allowed := true
	for _, p := range plans {
		if p.Concurrency {
			allowed = allowed && p.Capacity-r.held(&p) >= n
		}
	}
	var bucket TokenBucket
	if slices.Contains(plans, semBucket) {
		bucket = r.storedBucket()
		refilled := bucket.refill(&semBucket, r.now)
		allowed = allowed && refilled.Tokens >= n*microTokens
		switch {
		case allowed:
			refilled.Tokens -= n * microTokens
			r.bucket = &refilled
		case bucket.tooFarAhead(&semBucket, r.now):
			r.bucket = &refilled
		}
	}
	if allowed {
		for _, p := range concurrencyOf(plans) {
			if r.sems[p.Name] == nil {
				r.sems[p.Name] = map[string]permitLease{}
			}
			r.sems[p.Name][id] = permitLease{n: n, ends: r.now + lease}
		}
	}

	assert.Equal(r.t, reclaimed, onMemory.reclaimed, "MemoryStore reclaims as the model does, %s", r.where())
	assert.Equal(r.t, inSets, onRedis.reclaimed, "Redis reclaims as the model does, but for sets it deleted, %s", r.where())
	onRedis.reclaimed, onMemory.reclaimed = 0, 0
	assert.Equal(r.t, onMemory, onRedis, "Lua and MemoryStore disagree, %s", r.where())
	assert.Equal(r.t, allowed, onRedis.Allowed, "both or neither: permits %v and tokens %+v, %s", r.sems, bucket, r.where())
	for _, pr := range onRedis.PlanResults() {
		for _, p := range plans {
			if p.Name == pr.Plan && p.Concurrency {
				assert.Equal(r.t, max(p.Capacity-r.held(&p), 0), pr.Remaining, "plan %s: Remaining is its free permits, %s", p.Name, r.where())
			}
		}
	}
	r.check()
}

// decide has s decide the Acquire of holder id, and checks that it fills
// in the grant exactly when it allows it.
func (r *permitRig) decide(s decider, id string, n, lease int64, plans []Plan) Result {
	g := &permit{id: id, lease: time.Duration(lease) * time.Microsecond, backs: &giveBacks{}}
	res, err := s.decide(r.ctx, op{key: semKey, n: n, mode: modeAcquire, plans: plans, grant: g})
	require.NoError(r.t, err, r.where())
	assert.Equal(r.t, res.Allowed, g.store != nil, "a granted Acquire names its store, %s", r.where())
	return res
}

// planNames lists the names of plans.
func planNames(plans []Plan) string {
	var b strings.Builder
	for _, p := range plans {
		b.WriteString(p.Name + " ")
	}
	return strings.TrimSpace(b.String())
}

// storedBucket returns the model's bucket, full at now if none is
// stored.
func (r *permitRig) storedBucket() TokenBucket {
	if r.bucket == nil {
		return fullBucket(semBucket, r.now)
	}
	return *r.bucket
}

// permits has both stores renew, for lease µs, or release, for 0, the
// permits of holders ids, as a Permit or a Limiter's renewals ask, or
// adopt them for lease, as a Limiter's renewals move permits its fallback
// granted, and checks the answers.
func (r *permitRig) permits(lease int64, ids []string, adopt bool) {
	o := permitOp{key: semKey, lease: time.Duration(lease) * time.Microsecond, adopt: adopt}
	for _, id := range ids {
		h := permitHolder{id: id, n: r.ns[id]}
		for _, p := range r.plansOf(id) {
			h.mask |= 1 << planIndex(&o.plans, p)
		}
		o.holders = append(o.holders, h)
	}
	r.note("permits lease=%d adopt=%v holders %+v on %s", lease, adopt, o.holders, planNames(o.plans))
	sets := r.inRedis(o.plans)
	replyR, err := r.rs.permits(r.ctx, o)
	require.NoError(r.t, err, r.where())
	replyM, err := r.ms.permits(r.ctx, o)
	require.NoError(r.t, err, r.where())
	liveR, reclaimedR, liveM, reclaimedM := replyR.live, replyR.reclaimed, replyM.live, replyM.reclaimed

	reclaimed, inSets := r.reclaim(o.plans, sets)
	live := make([]bool, len(o.holders))
	for h, x := range o.holders {
		live[h] = true
		for i, p := range o.plans {
			if !adopt && x.mask&(1<<i) != 0 {
				held, ok := r.sems[p.Name][x.id]
				live[h] = live[h] && ok && held.n == x.n
			}
		}
		for i, p := range o.plans {
			switch {
			case x.mask&(1<<i) == 0:
			case live[h] && lease > 0:
				if r.sems[p.Name] == nil {
					r.sems[p.Name] = map[string]permitLease{}
				}
				r.sems[p.Name][x.id] = permitLease{n: x.n, ends: r.now + lease}
			default:
				delete(r.sems[p.Name], x.id)
			}
		}
	}
	assert.Equal(r.t, live, liveM, "MemoryStore's live flags, %s", r.where())
	assert.Equal(r.t, live, liveR, "Lua's live flags, %s", r.where())
	assert.Equal(r.t, reclaimed, reclaimedM, "MemoryStore reclaims as the model does, %s", r.where())
	assert.Equal(r.t, inSets, reclaimedR, "Redis reclaims as the model does, but for sets it deleted, %s", r.where())
	r.check()
}

// plansOf returns the concurrency plans holder id acquired on: those of
// the model that hold it, or, for one that holds nothing (refused,
// released, lost), a plan it may have asked for.
func (r *permitRig) plansOf(id string) []Plan {
	var out []Plan
	for _, p := range []Plan{semInflight, semPool} {
		if _, ok := r.sems[p.Name][id]; ok {
			out = append(out, p)
		}
	}
	if out == nil {
		out = []Plan{semInflight}
	}
	return out
}

// lastEnd returns when the model's last lease ends, or now if none.
func (r *permitRig) lastEnd() int64 {
	at := r.now
	for _, hs := range r.sems {
		for _, h := range hs {
			at = max(at, h.ends)
		}
	}
	return at
}

// check compares the state of both stores with the model: the permits
// of each concurrency plan, member for member in Redis and holder for
// holder in memory, and the bucket's tokens and stamp.
func (r *permitRig) check() {
	r.t.Helper()
	e, unlock := lockedEntry(r.ms, semKey)
	defer unlock()
	for _, p := range []Plan{semInflight, semPool} {
		want := map[string]permitLease{}
		members := map[string]float64{}
		live, last := 0, int64(0)
		for id, h := range r.sems[p.Name] {
			want[id] = h
			for j := int64(1); j <= h.n; j++ {
				members[id+"."+strconv.FormatInt(j, 10)] = float64(h.ends)
			}
			if h.ends > r.now {
				live++
			}
			last = max(last, h.ends)
		}
		var got map[string]permitLease
		var held int64
		if s := e.semaphore(&p); s != nil {
			got, held = s.holders, s.held
		}
		assert.Equal(r.t, want, maps.Collect(maps.All(got)), "plan %s: the MemoryStore's holders, %s", p.Name, r.where())
		assert.Equal(r.t, r.held(&p), held, "plan %s: the MemoryStore counts what its holders hold, %s", p.Name, r.where())
		if !r.mr.Exists(r.setKey(&p)) {
			assert.Zero(r.t, live, "plan %s: Redis deleted a set that holds live permits, %s", p.Name, r.where())
			continue
		}
		// A set expires 2 ms after its latest score, which only a release
		// or a renewal lowers, and each sets its expiry again.
		assert.False(r.t, r.ttl && r.now >= last+2000, "plan %s: Redis kept a set 2 ms past its last lease, %s", p.Name, r.where())
		inRedis := map[string]float64{}
		zs, err := r.mr.ZMembers(r.setKey(&p))
		require.NoError(r.t, err)
		for _, m := range zs {
			inRedis[m], err = r.mr.ZScore(r.setKey(&p), m)
			require.NoError(r.t, err)
		}
		assert.Equal(r.t, members, inRedis, "plan %s: the members in Redis, %s", p.Name, r.where())
	}
	r.checkBucket(e)
}

// checkBucket compares the bucket in both stores, e being the
// MemoryStore's entry, with the model.
func (r *permitRig) checkBucket(e *memEntry) {
	var inMemory *TokenBucket
	if b := e.find(&semBucket); b != nil {
		inMemory = &b.TokenBucket
	}
	assert.Equal(r.t, r.bucket, inMemory, "the MemoryStore's bucket, %s", r.where())
	rk := r.rs.Key(semKey, semBucket.Name)
	if !r.mr.Exists(rk) {
		assert.Equal(r.t, fullBucket(semBucket, r.now), r.storedBucket().refill(&semBucket, r.now),
			"Redis deleted a bucket that is not full, %s", r.where())
		return
	}
	b := storedBucket(r.t, r.rs.client, rk)
	assert.Equal(r.t, r.storedBucket(), TokenBucket{Tokens: b.Tokens, Stamp: b.Stamp}, "the bucket in Redis, %s", r.where())
}

// randomStep makes one random step: an Acquire, a release, a renewal of
// one to three holders, the clock past every lease, or a clock step
// (back too, unless the rig's TTLs follow the clock).
func (r *permitRig) randomStep(rng *rand.Rand) {
	leases := []int64{30_000, 200_000, 1_000_000, 3_000_000}
	switch k := rng.IntN(21); {
	case k < 8 || len(r.ids) == 0:
		plans := semChains[rng.IntN(len(semChains))]
		r.acquire(1+rng.Int64N(4), leases[rng.IntN(len(leases))], plans)
	case k < 12:
		r.permits(0, []string{r.pickID(rng)}, false)
	case k < 16:
		ids := []string{r.pickID(rng)}
		for range rng.IntN(3) {
			if id := r.pickID(rng); !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		r.permits(leases[rng.IntN(len(leases))], ids, k == 15)
	case k < 17:
		// Exactly at the last lease's end, which has then ended, or past it.
		r.advance(r.lastEnd() - r.now + []int64{0, 1, rng.Int64N(5000)}[rng.IntN(3)])
	case !r.ttl && k < 18:
		r.advance(-[]int64{1, rng.Int64N(500_000), rng.Int64N(4_000_000)}[rng.IntN(3)])
	default:
		r.advance([]int64{0, 1, 999, rng.Int64N(300_000), rng.Int64N(3_000_000)}[rng.IntN(5)])
	}
}

// pickID returns a holder id: mostly one the model holds, at times any
// acquired so far (refused, released, lost).
func (r *permitRig) pickID(rng *rand.Rand) string {
	var held []string
	for _, hs := range r.sems {
		for id := range hs {
			if !slices.Contains(held, id) {
				held = append(held, id)
			}
		}
	}
	slices.Sort(held) // map order is random; the steps must not be
	if len(held) > 0 && rng.IntN(4) > 0 {
		return held[rng.IntN(len(held))]
	}
	return r.ids[rng.IntN(len(r.ids))]
}

// TestPermitStoresAgreeOnRandomSteps is the property test of the two
// implementations of concurrency plans chained with a bucket: 10,000
// random Acquires, releases, renewals, lease ends and clock steps, back
// too, give the same answers from the script, on miniredis, and the
// MemoryStore, and the same state as a model in which an Acquire takes
// its permits and its tokens both or neither. With TTLs that follow the
// clock (4,000 steps, forward only), Redis deletes sets whose leases all
// ended, and reclaims nothing there.
func TestPermitStoresAgreeOnRandomSteps(t *testing.T) {
	for _, tt := range []struct {
		ttl   bool
		steps int
	}{{false, 10_000}, {true, 4000}} {
		t.Run(fmt.Sprint("ttl=", tt.ttl), func(t *testing.T) {
			steps := tt.steps
			if testing.Short() {
				steps /= 10
			}
			r := newPermitRig(t, tt.ttl)
			rng := rand.New(rand.NewPCG(27, 1))
			for range steps {
				r.randomStep(rng)
				if t.Failed() {
					return
				}
			}
		})
	}
}

// FuzzPermitAgreement is TestPermitStoresAgreeOnRandomSteps on the
// fuzzer's seeds.
func FuzzPermitAgreement(f *testing.F) {
	f.Add(uint64(1), uint64(2), false)
	f.Add(uint64(3), uint64(4), true)
	f.Fuzz(func(t *testing.T, a, b uint64, ttl bool) {
		r := newPermitRig(t, ttl)
		rng := rand.New(rand.NewPCG(a, b))
		for range 300 {
			r.randomStep(rng)
			if t.Failed() {
				return
			}
		}
	})
}

// TestMemoryPermitsFreeableOnceReleasedOrEnded: a MemoryStore's entry
// whose permits were all released, or whose leases all ended, may be
// forgotten for free (fullAt), as Redis deletes the set; not before.
func TestMemoryPermitsFreeableOnceReleasedOrEnded(t *testing.T) {
	now := t0
	m := newClockedMemoryStore(&now)
	freeable := func() bool {
		e, unlock := lockedEntry(m, "k")
		defer unlock()
		require.NotNil(t, e)
		return e.fullAt(now) <= now
	}
	p := Plan{Name: "inflight", Capacity: 5, Concurrency: true}
	acquireOn(t, m, "a", 2, time.Second, p)
	acquireOn(t, m, "b", 1, 3*time.Second, p)
	assert.False(t, freeable(), "permits are held")
	require.True(t, permitsOn(t, m, "a", 2, 0, p))
	assert.False(t, freeable(), "b's permit is held")
	require.True(t, permitsOn(t, m, "b", 1, 0, p))
	assert.True(t, freeable(), "every permit released")

	acquireOn(t, m, "c", 2, time.Second, p)
	now += 500_000
	require.True(t, permitsOn(t, m, "c", 2, 2*time.Second, p), "renewed before its lease ended")
	now += 2_000_000 - 1
	assert.False(t, freeable(), "the renewed lease still runs")
	now++
	assert.True(t, freeable(), "every lease ended")
}

// kindRig runs the same steps on plans of one name that change kind, on
// a MemoryStore and on miniredis at one instant, and demands the same
// answers.
type kindRig struct {
	t  *testing.T
	ms *MemoryStore
	rs *RedisStore
	mr *miniredis.Miniredis
}

func newKindRig(t *testing.T) *kindRig {
	rs, mr, _ := newMiniredisStore(t)
	now := t0
	return &kindRig{t: t, ms: newClockedMemoryStore(&now), rs: rs, mr: mr}
}

// take has both stores Take cost of plans.
func (k *kindRig) take(cost int64, plans ...Plan) Result {
	k.t.Helper()
	r, err := k.rs.Take(context.Background(), "k", cost, plans)
	require.NoError(k.t, err)
	m, err := k.ms.Take(context.Background(), "k", cost, plans)
	require.NoError(k.t, err)
	assert.Equal(k.t, m, r, "Lua and MemoryStore disagree")
	return r
}

// acquire has both stores decide an Acquire of n permits of plans for
// holder id.
func (k *kindRig) acquire(id string, n int64, plans ...Plan) Result {
	k.t.Helper()
	do := func(s decider) Result {
		g := &permit{id: id, lease: time.Minute, backs: &giveBacks{}}
		r, err := s.decide(context.Background(), op{key: "k", n: n, mode: modeAcquire, plans: plans, grant: g})
		require.NoError(k.t, err)
		return r
	}
	r, m := do(k.rs), do(k.ms)
	assert.Equal(k.t, m, r, "Lua and MemoryStore disagree")
	return r
}

// permits has both stores renew, or release for a lease of 0, holder
// id's n permits of p, and returns whether they were live.
func (k *kindRig) permits(id string, n int64, lease time.Duration, p Plan) bool {
	k.t.Helper()
	r, m := permitsOn(k.t, k.rs, id, n, lease, p), permitsOn(k.t, k.ms, id, n, lease, p)
	assert.Equal(k.t, m, r, "Lua and MemoryStore disagree")
	return r
}

// is requires the state of plan name in Redis to be of type typ.
func (k *kindRig) is(name, typ string) {
	k.t.Helper()
	require.Equal(k.t, typ, k.mr.Type(k.rs.Key("k", name)))
}

// TestPlanChangesKindToAndFromConcurrency: a plan name that held a
// bucket, then permits, then a window, then permits again (SetPlans, or
// instances with other plans): each kind reads the other's state as
// holding nothing of its own (no tokens taken, no permits held), a
// decision that writes replaces it, and one that is refused leaves it
// alone; both stores agree at every step.
func TestPlanChangesKindToAndFromConcurrency(t *testing.T) {
	bucket := Plan{Name: "x", Capacity: 4, Rate: 0.001}
	sem := Plan{Name: "x", Capacity: 3, Concurrency: true}
	window := Plan{Name: "x", Capacity: 4, Window: time.Minute, Slots: 4}
	empty := Plan{Name: "y", Capacity: 1, Rate: 0.001}
	k := newKindRig(t)

	require.EqualValues(t, 1, k.take(3, bucket).Remaining)
	k.is("x", "string")
	r := k.acquire("a", 2, sem)
	require.True(t, r.Allowed, "a bucket holds no permits")
	require.EqualValues(t, 1, r.Remaining, "3 free, 2 taken: the bucket's 1 token is no permit count")
	k.is("x", "zset")

	require.EqualValues(t, 3, k.take(1, bucket).Remaining, "the permits are no tokens taken: a full bucket")
	k.is("x", "string")
	require.False(t, k.permits("a", 2, time.Minute, sem), "the bucket replaced a's permits")
	require.False(t, k.permits("a", 2, 0, sem))
	k.is("x", "string")
	require.EqualValues(t, 3, k.take(0, bucket).Remaining, "a renewal and a release leave the bucket alone")

	require.True(t, k.take(1, empty).Allowed)
	r = k.acquire("b", 1, sem, empty)
	require.False(t, r.Allowed, "y has no token left")
	k.is("x", "string")
	require.EqualValues(t, 3, k.take(0, bucket).Remaining, "a refused Acquire leaves the bucket alone")

	r = k.acquire("c", 3, sem)
	require.True(t, r.Allowed)
	require.Zero(t, r.Remaining)
	require.True(t, k.permits("c", 3, time.Minute, sem), "renewed")
	k.is("x", "zset")

	require.EqualValues(t, 2, k.take(2, window).Remaining, "the permits are nothing admitted in a window")
	k.is("x", "hash")
	require.False(t, k.permits("c", 3, time.Minute, sem), "the window replaced c's permits")
	k.is("x", "hash")
	r = k.acquire("d", 3, sem)
	require.True(t, r.Allowed, "a window holds no permits")
	k.is("x", "zset")
	require.True(t, k.permits("d", 3, 0, sem))
	require.False(t, k.mr.Exists(k.rs.Key("k", "x")), "d released, nothing is left")
}

// TestLimitersOfBothKindsShareAName: two Limiters on one store, one
// with a bucket plan and one with a concurrency plan of the same name (a
// plan may not change kind within one Limiter), read each other's state
// as holding nothing of their own, in both stores; the permit held while
// the bucket writes is lost.
func TestLimitersOfBothKindsShareAName(t *testing.T) {
	ctx := context.Background()
	bucket := []Plan{{Name: "x", Capacity: 4, Rate: 0.001}}
	sem := []Plan{{Name: "x", Capacity: 3, Concurrency: true}}
	rs, _, _ := newMiniredisStore(t)
	now := t0 // miniredis's TIME too
	var results [2][]Result
	for i, s := range []Store{newClockedMemoryStore(&now), rs} {
		lb, err := New(s, bucket, WithLogger(nil), WithFailurePolicy(breaker.FailClosed))
		require.NoError(t, err)
		ls, err := New(s, sem, WithLogger(nil), WithFailurePolicy(breaker.FailClosed))
		require.NoError(t, err)
		t.Cleanup(func() { _, _ = lb.Close(), ls.Close() })
		r, err := lb.AllowN(ctx, "k", 3)
		require.NoError(t, err)
		results[i] = append(results[i], r)
		p, err := ls.Acquire(ctx, "k", 3, "x")
		require.NoError(t, err)
		require.True(t, p.OK(), "a bucket holds no permits")
		results[i] = append(results[i], p.Result())
		r, err = lb.Allow(ctx, "k")
		require.NoError(t, err)
		require.EqualValues(t, 3, r.Remaining, "permits are no tokens taken")
		results[i] = append(results[i], r)
		require.ErrorIs(t, p.Release(ctx), ErrPermitLost, "the bucket replaced its permits")
	}
	assert.Equal(t, results[0], results[1], "Lua and MemoryStore disagree")
}
