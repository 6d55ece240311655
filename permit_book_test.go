package tollgate

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// holderChildEnv carries a windowJob to TestPermitHolderChildProcess.
const holderChildEnv = "TOLLGATE_PERMIT_HOLDER_CHILD"

// The lease of the holder that TestKilledHoldersPermitsComeBackOnRealRedis
// kills, the interval its Limiter renews it at, and how much later than
// the one before a renewal may reach Redis: a round trip after its tick.
const (
	holderLease    = 600 * time.Millisecond
	holderInterval = holderLease / 3
	renewalJitter  = 25 * time.Millisecond
)

// inflight3 is the plan of TestKilledHoldersPermitsComeBackOnRealRedis.
var inflight3 = Plan{Name: "inflight", Capacity: 3, Concurrency: true}

// newHolderLimiter returns a Limiter on inflight3 in the Redis at addr,
// its keys under prefix, closed when t ends.
func newHolderLimiter(t *testing.T, addr, prefix string) *Limiter {
	t.Helper()
	c := redistest.NewClient(t, &redis.Options{Addr: addr})
	l, err := New(NewRedisStore(c, WithKeyPrefix(prefix)), []Plan{inflight3},
		WithPermitLease(holderLease), WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// TestPermitHolderChildProcess is not a test of its own:
// TestKilledHoldersPermitsComeBackOnRealRedis runs the test binary again
// with this test selected and a job in its environment. It acquires all 3
// permits of inflight3, prints "held" and the Redis TIME of the grant,
// and holds them, renewed, until its standard input closes: until its
// parent kills it, or dies.
func TestPermitHolderChildProcess(t *testing.T) {
	spec := os.Getenv(holderChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestKilledHoldersPermitsComeBackOnRealRedis")
	}
	var job windowJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	l := newHolderLimiter(t, job.Addr, job.Prefix)
	p, err := l.Acquire(context.Background(), "k", 3, inflight3.Name)
	require.NoError(t, err)
	require.True(t, p.OK())
	fmt.Printf("held %d\n", p.grant.decidedAt)
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// startHolder runs TestPermitHolderChildProcess with job, waits until it
// holds its permits, and returns it and the Redis TIME of its grant. The
// process is killed when t ends, if it still runs.
func startHolder(t *testing.T, job windowJob) (*exec.Cmd, int64) {
	t.Helper()
	spec, err := json.Marshal(job)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hung child is killed
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestPermitHolderChildProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), holderChildEnv+"="+string(spec))
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = stdin.Close()
		cancel()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err, "the holder printed %q", line)
	var at int64
	_, err = fmt.Sscanf(line, "held %d\n", &at)
	require.NoError(t, err, "the holder printed %q", line)
	return cmd, at
}

// TestKilledHoldersPermitsComeBackOnRealRedis kills with SIGKILL a
// process that holds all 3 permits of a key, renewed every third of a
// 600 ms lease, and acquires one permit again and again until it is
// granted. Its last renewal reached Redis at most one interval before the
// kill (and a little jitter), and none after: the permits come back when
// the lease it set ends, not before, which is at least the lease less an
// interval after the kill, and at most the lease after it; the test
// allows a second more for a noisy machine.
func TestKilledHoldersPermitsComeBackOnRealRedis(t *testing.T) {
	if os.Getenv(holderChildEnv) != "" {
		t.Skip("a child runs only TestPermitHolderChildProcess")
	}
	ctx := context.Background()
	addr := redistest.Addr(t)
	c := redistest.NewClient(t, &redis.Options{Addr: addr})
	prefix := redistest.KeyPrefix()
	holder, acquired := startHolder(t, windowJob{Addr: addr, Prefix: prefix})
	l := newHolderLimiter(t, addr, prefix)
	acquire := func() *Permit {
		p, err := l.Acquire(ctx, "k", 1, inflight3.Name)
		require.NoError(t, err)
		return p
	}

	time.Sleep(2*holderLease + rand.N(holderInterval)) // at any moment between two renewals
	require.False(t, acquire().OK(), "the holder renews its permits beyond their first lease")
	before := redistest.Time(t, c)
	require.Greater(t, before-acquired, holderLease.Microseconds(), "the holder outlived its first lease")
	require.NoError(t, holder.Process.Signal(syscall.SIGKILL))
	require.ErrorContains(t, holder.Wait(), "killed")
	after := redistest.Time(t, c)
	leases, err := c.ZRangeWithScores(ctx, NewRedisStore(c, WithKeyPrefix(prefix)).Key("k", inflight3.Name), 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, leases, 3, "the dead holder's permits")
	require.Equal(t, leases[0].Score, leases[2].Score, "one renewal call renews all three")
	ends := int64(leases[0].Score)

	var granted *Permit
	deadline := time.Now().Add(holderLease + holderInterval + 2*time.Second)
	for granted == nil && time.Now().Before(deadline) {
		if p := acquire(); p.OK() {
			granted = p
		}
		time.Sleep(2 * time.Millisecond)
	}
	require.NotNil(t, granted, "the dead holder's permits never came back")
	back := granted.grant.decidedAt
	t.Logf("killed between %v and %v after the grant; lease ends %v after the kill; back %v after it",
		us(before-acquired), us(after-acquired), us(ends-before), us(back-before))
	assert.GreaterOrEqual(t, back-before, ends-before, "a permit came back before its lease ended")
	assert.LessOrEqual(t, ends-after, holderLease.Microseconds(), "the lease ends more than a lease after the kill")
	assert.GreaterOrEqual(t, back-before, (holderLease - holderInterval - renewalJitter).Microseconds(),
		"refused for less than the lease less a renewal interval after the kill")
	assert.LessOrEqual(t, back-after, (holderLease + holderInterval + time.Second).Microseconds(),
		"granted later than the lease and a renewal interval after the kill (and a second for a noisy machine)")
}

// us returns a span of n µs.
func us(n int64) time.Duration { return time.Duration(n) * time.Microsecond }

// TestFallbackPermitsMoveIntoTheStore has the fallback grant permits while
// Redis fails, then Redis answer again with none of them (as a Redis
// restarted empty would): once the key's breaker is closed, the renewals
// move them into Redis, which then refuses what it would otherwise grant
// beside them, and their Release frees them there.
func TestFallbackPermitsMoveIntoTheStore(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	l, err := New(rs, permitPlans, WithLogger(nil), WithPermitLease(300*time.Millisecond),
		WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	p := acquireInOutageThenRecover(t, l, mr, 2)
	q, err := l.Acquire(ctx, "k", 2, "inflight")
	require.NoError(t, err)
	require.Equal(t, SourceStore, q.Result().Source)
	require.False(t, q.OK(), "Redis counts the 2 permits the fallback granted")
	require.NoError(t, p.Release(ctx))
	q, err = l.Acquire(ctx, "k", 3, "inflight")
	require.NoError(t, err)
	require.True(t, q.OK(), "released in Redis, where they moved")
	require.NoError(t, q.Release(ctx))
}

// TestCloseWhileHoldersRelease has Close run while every holder
// releases: neither waits on the other's lock, and both end.
func TestCloseWhileHoldersRelease(t *testing.T) {
	ctx := context.Background()
	for range 10 {
		l, err := New(NewMemoryStore(), []Plan{{Name: "c", Capacity: maxPermits, Concurrency: true}}, WithLogger(nil))
		require.NoError(t, err)
		var ps []*Permit
		for i := range 1000 {
			p, err := l.Acquire(ctx, fmt.Sprint("k", i%7), 1, "c")
			require.NoError(t, err)
			ps = append(ps, p)
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, p := range ps {
			wg.Go(func() { <-start; _ = p.Release(ctx) })
		}
		wg.Go(func() { <-start; _ = l.Close() })
		close(start)
		ended := make(chan struct{})
		go func() { wg.Wait(); close(ended) }()
		select {
		case <-ended:
		case <-time.After(10 * time.Second):
			t.Fatal("Close and Release wait on each other")
		}
	}
}

// TestCloseConcurrently has several Closes at once stop one renewal
// goroutine: none panics, and all return.
func TestCloseConcurrently(t *testing.T) {
	ctx := context.Background()
	for range 500 {
		l, err := New(NewMemoryStore(), []Plan{{Name: "c", Capacity: 3, Concurrency: true}}, WithLogger(nil))
		require.NoError(t, err)
		_, err = l.Acquire(ctx, "k", 1, "c") // starts the renewals
		require.NoError(t, err)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() { <-start; _ = l.Close() })
		}
		close(start)
		wg.Wait()
	}
}

// TestPermitAcquiredAfterCloseIsRenewed: the Limiter still decides after
// Close, and a permit it grants then is renewed while its holder works,
// until the next Close.
func TestPermitAcquiredAfterCloseIsRenewed(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{{Name: "c", Capacity: 1, Concurrency: true}}, WithLogger(nil),
		WithPermitLease(300*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, l.Close())
	p, err := l.Acquire(ctx, "k", 1, "c")
	require.NoError(t, err)
	require.True(t, p.OK())
	time.Sleep(time.Second) // its holder works
	q, err := l.Acquire(ctx, "k", 1, "c")
	require.NoError(t, err)
	require.False(t, q.OK(), "renewed after Close: still held")
	require.NoError(t, l.Close())
	require.ErrorIs(t, p.Release(ctx), ErrNotHeld, "Close released it")
}

// hungStore stands for a store whose node hangs (a Cluster master behind
// a black hole): each of its decisions and permits calls lasts until its
// context ends. It decides, so that a Limiter on it takes concurrency
// plans.
type hungStore struct{}

func (s hungStore) self() Store { return s }
func (hungStore) decide(ctx context.Context, _ op) (Result, error) {
	<-ctx.Done()
	return Result{}, ctx.Err()
}

func (hungStore) Take(context.Context, string, int64, []Plan) (Result, error) { return Result{}, nil }
func (hungStore) Reset(context.Context, string, []Plan) error                 { return nil }
func (hungStore) permits(ctx context.Context, _ permitOp) (permitReply, error) {
	<-ctx.Done()
	return permitReply{}, ctx.Err()
}

// TestHungKeysDoNotStallOtherRenewals has the renewals of 200 keys hang
// on every pass: the permit of a healthy key is renewed all the same, and
// outlives its lease while its holder works.
func TestHungKeysDoNotStallOtherRenewals(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "c", Capacity: 1, Concurrency: true}
	l, err := New(NewMemoryStore(), []Plan{plan}, WithLogger(nil), WithPermitLease(300*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	for i := range 200 { // more than any pool of workers would have
		l.book.add(&Permit{l: l, key: fmt.Sprint("hung", i), n: 1, plans: []Plan{plan}, result: Result{Allowed: true},
			grant: permit{id: newPermitID(), lease: l.permitLease, store: hungStore{}}})
	}
	p, err := l.Acquire(ctx, "healthy", 1, "c")
	require.NoError(t, err)
	require.True(t, p.OK())
	time.Sleep(2 * time.Second) // its holder works
	q, err := l.Acquire(ctx, "healthy", 1, "c")
	require.NoError(t, err)
	require.False(t, q.OK(), "renewed while the hung keys' renewals waited")
	require.NoError(t, p.Release(ctx))
}

// TestAdoptionWhileTheFallbackCounts moves a permit the fallback granted
// into the store while Acquires that fall back count the permits held
// from the store (lessHeld): under the race detector, the move and the
// count share a lock.
func TestAdoptionWhileTheFallbackCounts(t *testing.T) {
	l, p := fallbackPermit(t)
	plan := p.plans[0]
	_, err := l.fallback.(decider).decide(context.Background(), op{key: "k", n: 1, mode: modeAcquire, plans: p.plans, grant: &p.grant})
	require.NoError(t, err)
	require.Same(t, l.fallback, p.grant.store)
	l.book.add(p)
	for l.Stats().Permits.Adopted == 0 {
		_ = l.lessHeld([]Plan{plan}, "k", l.store) // as an Acquire that falls back does
		time.Sleep(time.Millisecond)
	}
	require.Equal(t, []Plan{{Name: "c", Capacity: 9, Concurrency: true}}, l.lessHeld([]Plan{plan}, "k", l.store),
		"held from the store once adopted")
}

// TestRenewalsStopWhenNothingIsHeld: the goroutine that renews ends once
// every permit is released, so that a Limiter never closed holds none,
// and the next Acquire starts it again.
func TestRenewalsStopWhenNothingIsHeld(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{{Name: "c", Capacity: 1, Concurrency: true}}, WithLogger(nil),
		WithPermitLease(minPermitLease))
	require.NoError(t, err)
	renewing := func() bool {
		l.book.mu.Lock()
		defer l.book.mu.Unlock()
		return l.book.stop != nil
	}
	for range 2 {
		p, err := l.Acquire(ctx, "k", 1, "c")
		require.NoError(t, err)
		require.True(t, renewing())
		require.NoError(t, p.Release(ctx))
		require.Eventually(t, func() bool { return !renewing() }, 5*time.Second, time.Millisecond)
	}
}

// TestAdoptionLeavesWhatTheFallbackLost: a permit the fallback no longer
// holds (its lease ended there) is not moved into the store; its Release
// says it was lost.
func TestAdoptionLeavesWhatTheFallbackLost(t *testing.T) {
	ctx := context.Background()
	l, p := fallbackPermit(t)
	p.grant.store = l.fallback
	l.book.add(p) // the fallback holds nothing of it
	require.Eventually(t, func() bool { return l.Stats().Permits.Lost == 1 }, 5*time.Second, time.Millisecond)
	require.Zero(t, l.Stats().Permits.Adopted)
	require.ErrorIs(t, p.Release(ctx), ErrPermitLost)
}

// gateStore is a store whose first renewal waits for gate, after closing
// entered, and which then finds every holder lost.
type gateStore struct {
	entered, gate chan struct{}
	calls         *atomic.Int32
}

func (gateStore) Take(context.Context, string, int64, []Plan) (Result, error) { return Result{}, nil }
func (gateStore) Reset(context.Context, string, []Plan) error                 { return nil }
func (s gateStore) permits(_ context.Context, o permitOp) (permitReply, error) {
	if o.lease > 0 && s.calls.Add(1) == 1 {
		close(s.entered)
		<-s.gate
	}
	return permitReply{live: make([]bool, len(o.holders))}, nil
}

// TestCloseCountsALostPermitOnce has a renewal find a permit lost while
// Close releases the book: it is counted lost once, and its Release says
// so.
func TestCloseCountsALostPermitOnce(t *testing.T) {
	plan := Plan{Name: "c", Capacity: 1, Concurrency: true}
	l, err := New(NewMemoryStore(), []Plan{plan}, WithLogger(nil), WithPermitLease(300*time.Millisecond))
	require.NoError(t, err)
	s := gateStore{entered: make(chan struct{}), gate: make(chan struct{}), calls: new(atomic.Int32)}
	p := &Permit{l: l, key: "k", n: 1, plans: []Plan{plan}, result: Result{Allowed: true},
		grant: permit{id: newPermitID(), lease: l.permitLease, store: s}}
	l.book.add(p)
	<-s.entered // a renewal is under way
	closed := make(chan struct{})
	go func() { _ = l.Close(); close(closed) }()
	require.Eventually(t, func() bool {
		l.book.mu.Lock()
		defer l.book.mu.Unlock()
		return l.book.stop == nil
	}, 5*time.Second, time.Millisecond)
	close(s.gate) // the renewal finds it lost
	<-closed
	require.EqualValues(t, 1, l.Stats().Permits.Lost)
	require.ErrorIs(t, p.Release(context.Background()), ErrPermitLost)
}

// TestReleaseWaitsForNoMove has a move of the fallback's permit into the
// store hang: the permit's Release does not wait for it.
func TestReleaseWaitsForNoMove(t *testing.T) {
	plan := Plan{Name: "c", Capacity: 10, Concurrency: true}
	l, err := New(hungStore{}, []Plan{plan}, WithLogger(nil), WithPermitLease(9*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	p := &Permit{l: l, key: "k", n: 1, plans: []Plan{plan}, result: Result{Allowed: true},
		grant: permit{id: newPermitID(), lease: l.permitLease, backs: &l.backs}}
	_, err = l.fallback.(decider).decide(context.Background(), op{key: "k", n: 1, mode: modeAcquire, plans: p.plans, grant: &p.grant})
	require.NoError(t, err)
	l.book.add(p)
	time.Sleep(3200 * time.Millisecond) // the first pass's move hangs on the store
	start := time.Now()
	require.NoError(t, p.Release(context.Background()))
	require.Less(t, time.Since(start), detachTimeout, "a release waits for no move")
}

// TestCloseWaitsForNoHungPass has a renewal pass hang on a store: Close
// cuts it short, and ends within its own release bound, not the pass's.
func TestCloseWaitsForNoHungPass(t *testing.T) {
	plan := Plan{Name: "c", Capacity: 1, Concurrency: true}
	l, err := New(NewMemoryStore(), []Plan{plan}, WithLogger(nil), WithPermitLease(9*time.Second))
	require.NoError(t, err)
	l.book.add(&Permit{l: l, key: "k", n: 1, plans: []Plan{plan}, result: Result{Allowed: true},
		grant: permit{id: newPermitID(), lease: l.permitLease, store: hungStore{}}})
	time.Sleep(3100 * time.Millisecond) // a pass, of 3 s, hangs on the store
	start := time.Now()
	require.NoError(t, l.Close())
	require.Less(t, time.Since(start), detachTimeout+time.Second, "the hung pass is cut short")
}

// fallbackPermit returns a Limiter on miniredis with a concurrency plan
// "c" of 10 and a lease of 30 ms, and a granted Permit of one on key "k"
// made by hand, as its fallback would make it, for a test to place.
func fallbackPermit(t *testing.T) (*Limiter, *Permit) {
	rs, _, _ := newMiniredisStore(t)
	plan := Plan{Name: "c", Capacity: 10, Concurrency: true}
	l, err := New(rs, []Plan{plan}, WithLogger(nil), WithPermitLease(30*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l, &Permit{l: l, key: "k", n: 1, plans: []Plan{plan}, result: Result{Allowed: true},
		grant: permit{id: newPermitID(), lease: l.permitLease, backs: &l.backs}}
}

// TestPermitsOfARedisFallbackMoveIntoTheStore is
// TestFallbackPermitsMoveIntoTheStore with a RedisStore as the fallback
// (WithFallback): its permits move into the store once the key's breaker
// is closed, as a MemoryStore's do, or the store would grant its whole
// capacity again beside them (before: 3 held of 3 from the fallback, 3
// more granted by the store).
func TestPermitsOfARedisFallbackMoveIntoTheStore(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	fallback, _, _ := newMiniredisStore(t)
	l, err := New(rs, permitPlans, WithLogger(nil), WithPermitLease(300*time.Millisecond), WithFallback(fallback),
		WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	p := acquireInOutageThenRecover(t, l, mr, 3)
	q, err := l.Acquire(ctx, "k", 1, "inflight")
	require.NoError(t, err)
	require.False(t, q.OK(), "the store counts the 3 permits the fallback granted")
	require.NoError(t, p.Release(ctx))
	n, err := fallback.client.Exists(ctx, fallback.Key("k", "inflight")).Result()
	require.NoError(t, err)
	require.Zero(t, n, "nothing left in the fallback")
}

// acquireInOutageThenRecover acquires n permits of "inflight" on key k of
// l while its store, on mr, fails, which its fallback grants; then it
// heals mr and waits for the probe that closes the breaker and for the
// permits' move into the store.
func acquireInOutageThenRecover(t *testing.T, l *Limiter, mr *miniredis.Miniredis, n int64) *Permit {
	t.Helper()
	p := acquireInOutage(t, l, mr, n)
	require.Eventually(t, func() bool { return l.Stats().Permits.Adopted == 1 }, 5*time.Second, 5*time.Millisecond,
		"the fallback's permits move into the store")
	return p
}

// TestRenewalsOfAKeyHoldingManyPlans has one Limiter hold a permit of each
// of 65 concurrency plans on one key, each plan of capacity 1, for three
// leases: every permit is renewed, so none of the plans grants a second.
// Before, a key's renewal was one call for every plan held there, each
// holder's plans a bit of a 64-bit mask: the 65th plan's bit was lost, its
// permit never renewed, and the plan granted a second while the first was
// held (2 held of 1), with that holder's renewals reporting it alive.
func TestRenewalsOfAKeyHoldingManyPlans(t *testing.T) {
	ctx := context.Background()
	plans := make([]Plan, 65)
	for i := range plans {
		plans[i] = Plan{Name: fmt.Sprintf("model-%02d", i), Capacity: 1, Concurrency: true}
	}
	stores := map[string]Store{"memory": NewMemoryStore()}
	if redistest.Available() {
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		stores["redis"] = NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	}
	for name, s := range stores {
		t.Run(name, func(t *testing.T) {
			l, err := New(s, plans, WithLogger(nil), WithPermitLease(300*time.Millisecond))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			held := make([]*Permit, len(plans))
			for i, p := range plans {
				held[i], err = l.Acquire(ctx, "tenant", 1, p.Name)
				require.NoError(t, err)
				require.True(t, held[i].OK())
			}
			time.Sleep(time.Second) // three leases, each renewed
			var twice []string
			for _, p := range plans {
				q, err := l.Acquire(ctx, "tenant", 1, p.Name)
				require.NoError(t, err)
				if q.OK() {
					twice = append(twice, p.Name)
				}
			}
			require.Empty(t, twice, "plans that granted a second permit of 1 while the first was held")
			for _, p := range held {
				require.NoError(t, p.Release(ctx))
			}
		})
	}
}

// TestStoreCountsTheFallbacksPermitsAtOnce: the fallback grants the 3
// permits of a key while Redis fails; Redis answers again and the key's
// breaker closes, and the next Acquire, before any renewal pass, goes to
// Redis. This Limiter knows it holds the 3: Redis must count them before
// it decides, not only once a renewal moves them (before: 3 more granted
// beside them, 6 held of 3 until the next pass, a third of a lease). They
// stay the fallback's until a renewal moves them, and are released there.
func TestStoreCountsTheFallbacksPermitsAtOnce(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	l, err := New(rs, permitPlans, WithLogger(nil), WithPermitLease(time.Hour),
		WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	p := acquireInOutage(t, l, mr, 3)

	q, err := l.Acquire(ctx, "k", 3, "inflight")
	require.NoError(t, err)
	require.Equal(t, SourceStore, q.Result().Source)
	assert.False(t, q.OK(), "Redis counts the 3 permits the fallback granted: %d held of 3",
		3+3*btoi(q.OK()))
	assert.Zero(t, l.Stats().Permits.Adopted, "no renewal pass ran")
	require.NoError(t, p.Release(ctx))
	q, err = l.Acquire(ctx, "k", 3, "inflight")
	require.NoError(t, err)
	assert.True(t, q.OK(), "released in the fallback, and counted no more")
	assert.Equal(t, SourceStore, q.Result().Source)
}

// acquireInOutage acquires n permits of "inflight" on key "k" from l's
// fallback while mr fails, then heals mr and waits for the probe that
// closes the breaker.
func acquireInOutage(t *testing.T, l *Limiter, mr *miniredis.Miniredis, n int64) *Permit {
	t.Helper()
	ctx := context.Background()
	mr.SetError("LOADING Redis is loading the dataset in memory")
	p, err := l.Acquire(ctx, "k", n, "inflight")
	require.NoError(t, err)
	require.True(t, p.OK())
	require.Equal(t, SourceFallback, p.Result().Source)
	mr.SetError("")
	require.Eventually(t, func() bool {
		r, err := l.Peek(ctx, "k", "daily") // the probe that closes the breaker
		return err == nil && r.Source == SourceStore
	}, 5*time.Second, 5*time.Millisecond)
	return p
}
