package tollgate

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// permitChildEnv carries a windowJob to TestAcquireChildProcess.
const permitChildEnv = "TOLLGATE_PERMIT_CHILD"

// inflight10 is the plan the processes of
// TestAcquireAcrossProcessesOnRealRedis share.
var inflight10 = Plan{Name: "inflight", Capacity: 10, Concurrency: true}

// Kinds of permitEvent, in the order a replay takes events of one µs:
// a release, then grants, the one that found the most free first, then
// refusals. Redis runs one script at a time, so only the decisions of
// one batch, which read TIME once, share a µs (the test checks it); and
// a batch holds acquires alone, which free no permit: each grant finds
// one fewer free than the one before it, and once one acquire is refused
// no later one is granted.
const (
	eventRelease = iota
	eventGrant
	eventRefuse
)

// permitEvent is one store step of a holder: an Acquire, granted or
// refused, or a Release, at the Redis TIME its script read (µs), and, for
// an Acquire, the permits its store found free before deciding it.
type permitEvent struct {
	At   int64 `json:"at"`
	Kind int   `json:"k"`
	Free int64 `json:"f,omitempty"`
	proc int   // the process, set by the parent
}

// permitReport is what a child of TestAcquireAcrossProcessesOnRealRedis
// prints: its events, and what went wrong.
type permitReport struct {
	Events   []permitEvent `json:"events"`
	Errors   int           `json:"errors"`
	FirstErr string        `json:"first_error,omitempty"`
	Lost     uint64        `json:"lost"`
}

// TestAcquireChildProcess is not a test of its own: the parent test runs
// the test binary again with this test selected and a job in its
// environment. Its goroutines acquire a permit of inflight10, hold it 0 to
// 3 ms and release it, again and again, and it prints every step at the
// Redis TIME of its script as JSON.
func TestAcquireChildProcess(t *testing.T) {
	spec := os.Getenv(permitChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestAcquireAcrossProcessesOnRealRedis")
	}
	var job windowJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	// A pool of 4 connections for 16 goroutines: the store decides some
	// acquires in batches, which read TIME once.
	c := redis.NewClient(&redis.Options{Addr: job.Addr, PoolSize: 4})
	defer c.Close()
	l, err := New(NewRedisStore(c, WithKeyPrefix(job.Prefix)), []Plan{inflight10},
		WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
	require.NoError(t, err)
	var mu sync.Mutex
	var rep permitReport
	deadline := time.Now().Add(job.Run)
	var wg sync.WaitGroup
	for range job.Workers {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				events, err := holdOnce(l)
				mu.Lock()
				rep.Events = append(rep.Events, events...)
				if err != nil && rep.Errors == 0 {
					rep.FirstErr = err.Error()
				}
				rep.Errors += btoi(err != nil)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.NoError(t, l.Close())
	rep.Lost = l.Stats().Permits.Lost
	out, err := json.Marshal(rep)
	require.NoError(t, err)
	fmt.Printf("%s\n", out)
}

// holdOnce acquires a permit of inflight10 on l and, if granted, holds
// it 0 to 3 ms and releases it, and returns the steps it took.
func holdOnce(l *Limiter) ([]permitEvent, error) {
	ctx := context.Background()
	p, err := l.Acquire(ctx, "shared", 1, inflight10.Name)
	if err != nil {
		return nil, err
	}
	r := p.Result()
	if !p.OK() {
		return []permitEvent{{At: p.grant.decidedAt, Kind: eventRefuse, Free: r.Remaining}}, nil
	}
	events := []permitEvent{{At: p.grant.decidedAt, Kind: eventGrant, Free: r.Remaining + 1}}
	time.Sleep(rand.N(3 * time.Millisecond))
	err = p.Release(ctx)
	return append(events, permitEvent{At: p.releasedAt, Kind: eventRelease}), err
}

// TestAcquireAcrossProcessesOnRealRedis runs 4 processes of 16
// goroutines that acquire and release permits of one key of capacity 10,
// and replays every grant, refusal and release at the Redis TIME its
// script read: never more than 10 held, every refusal made while 10 were
// held, and at every decision the held permits the store found.
func TestAcquireAcrossProcessesOnRealRedis(t *testing.T) {
	if os.Getenv(permitChildEnv) != "" {
		t.Skip("a child runs only TestAcquireChildProcess")
	}
	addr := redistest.Addr(t)
	var events []permitEvent
	for i, line := range runChildren(t, 4, "TestAcquireChildProcess", permitChildEnv,
		windowJob{Addr: addr, Prefix: redistest.KeyPrefix(), Workers: 16, Run: 1500 * time.Millisecond}) {
		var rep permitReport
		require.NoError(t, json.Unmarshal([]byte(line), &rep), line)
		assert.Zero(t, rep.Errors, "process %d: first error %s", i, rep.FirstErr)
		assert.Zero(t, rep.Lost, "process %d: a lease ended while held", i)
		granted := 0
		for _, e := range rep.Events {
			require.Positive(t, e.At, "process %d: a step without its Redis TIME", i)
			granted += btoi(e.Kind == eventGrant)
			e.proc = i
			events = append(events, e)
		}
		assert.Positive(t, granted, "process %d was never granted a permit", i)
	}
	slices.SortFunc(events, func(a, b permitEvent) int {
		return cmp.Or(cmp.Compare(a.At, b.At), cmp.Compare(a.Kind, b.Kind), cmp.Compare(b.Free, a.Free))
	})
	batched := 0
	for i := 1; i < len(events); i++ {
		a, b := events[i-1], events[i]
		batch := a.proc == b.proc && a.Kind != eventRelease && b.Kind != eventRelease
		require.True(t, a.At < b.At || batch, "two script calls read one µs of TIME: %+v, %+v", a, b)
		batched += btoi(a.At == b.At)
	}
	capacity := inflight10.Capacity
	var held, most int64
	over, unjustified, disagree, refusals := 0, 0, 0, 0
	for _, e := range events {
		if e.Kind != eventRelease && held != capacity-e.Free {
			disagree++
		}
		switch e.Kind {
		case eventRelease:
			held--
		case eventGrant:
			held++
			most = max(most, held)
			over += btoi(held > capacity)
		case eventRefuse:
			refusals++
			unjustified += btoi(held != capacity)
		}
	}
	t.Logf("%d steps (%d in a batch after another), %d refusals; at most %d of %d held", len(events), batched, refusals, most, capacity)
	assert.Zero(t, over, "grants beyond the capacity; at most %d held", most)
	assert.Zero(t, unjustified, "refusals while fewer than %d were held", capacity)
	assert.Zero(t, disagree, "decisions whose store found other than the replay held")
	assert.Zero(t, held, "every permit was released")
	assert.Equal(t, capacity, most, "the load must fill the key")
	assert.Positive(t, refusals, "the load must push past the capacity")
}

// permitRedis is a RedisStore under test, and how time passes for it.
type permitRedis struct {
	s *RedisStore
	// pass lets d go by on miniredis, TIME and TTLs alike; nil on real
	// Redis, whose clock runs by itself.
	pass func(d time.Duration)
}

// exists reports whether Redis holds key.
func (r permitRedis) exists(t *testing.T, key string) bool {
	n, err := r.s.client.Exists(context.Background(), key).Result()
	require.NoError(t, err)
	return n == 1
}

// permitRedises returns a RedisStore on miniredis, and on real Redis when
// there is one, by name.
func permitRedises(t *testing.T) map[string]permitRedis {
	t.Helper()
	mr := miniredis.RunT(t)
	now := t0
	mr.SetTime(time.UnixMicro(now))
	c := redistest.NewClient(t, &redis.Options{Addr: mr.Addr()})
	out := map[string]permitRedis{"miniredis": {s: NewRedisStore(c), pass: func(d time.Duration) {
		now += d.Microseconds()
		mr.SetTime(time.UnixMicro(now))
		mr.FastForward(d)
	}}}
	if redistest.Available() {
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		out["redis"] = permitRedis{s: NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))}
	}
	return out
}

// acquireOn has s decide an Acquire of n permits of plans for holder id
// with a lease, and requires it granted.
func acquireOn(t *testing.T, s decider, id string, n int64, lease time.Duration, plans ...Plan) {
	t.Helper()
	g := &permit{id: id, lease: lease, backs: &giveBacks{}}
	r, err := s.decide(context.Background(), op{key: "k", n: n, mode: modeAcquire, plans: plans, grant: g})
	require.NoError(t, err)
	require.True(t, r.Allowed, "%s acquires %d", id, n)
}

// permitsOn has s renew holder id's n permits of plan p for lease, or
// release them for 0, and returns whether they were live.
func permitsOn(t *testing.T, s permitStore, id string, n int64, lease time.Duration, p Plan) bool {
	t.Helper()
	reply, err := s.permits(context.Background(), permitOp{key: "k", plans: []Plan{p}, lease: lease,
		holders: []permitHolder{{id: id, n: n, mask: 1}}})
	require.NoError(t, err)
	return reply.live[0]
}

// TestPermitSetGoneOnceAllReleased: permits acquired through a Limiter,
// chained with a bucket, leave their set in Redis until the last of them
// is released, and nothing once it is.
func TestPermitSetGoneOnceAllReleased(t *testing.T) {
	ctx := context.Background()
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			l, err := New(r.s, permitPlans, WithLogger(nil), WithFailurePolicy(breaker.FailClosed))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			set := r.s.Key("k", "inflight")
			var held []*Permit
			for _, n := range []int64{1, 2} {
				p, err := l.Acquire(ctx, "k", n, "inflight", "daily")
				require.NoError(t, err)
				require.True(t, p.OK())
				held = append(held, p)
			}
			for _, p := range held {
				assert.True(t, r.exists(t, set), "permits are held: their set is there")
				require.NoError(t, p.Release(ctx))
			}
			assert.False(t, r.exists(t, set), "every permit released: nothing is left of the set")
			assert.True(t, r.exists(t, r.s.Key("k", "daily")), "the bucket stays until it is full again")
		})
	}
}

// TestPermitSetGoneOnceEveryLeaseEnded: permits never released leave
// their set in Redis until the last lease ends, and nothing once it
// ended: permits that were only acquired; permits one of which was
// renewed for less than its lease had left; and a permit left after the
// one with the longest lease was released. On miniredis the clock is
// exact: the set is there a µs before the last lease ends, and gone 2 ms
// after it.
func TestPermitSetGoneOnceEveryLeaseEnded(t *testing.T) {
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			p := Plan{Name: "inflight", Capacity: 5, Concurrency: true}
			set := r.s.Key("k", p.Name)
			goneAfter := func(last time.Duration) {
				t.Helper()
				if r.pass == nil { // no bound before: a slow machine may take the lease to get here
					assert.Eventually(t, func() bool { return !r.exists(t, set) }, 5*time.Second, 10*time.Millisecond,
						"every lease ended: nothing is left of the set")
					return
				}
				r.pass(last - time.Microsecond)
				require.True(t, r.exists(t, set), "a lease still runs: the set is there")
				r.pass(time.Microsecond + 2*time.Millisecond)
				assert.False(t, r.exists(t, set), "every lease ended: nothing is left of the set")
			}
			acquireOn(t, r.s, "a", 2, 100*time.Millisecond, p)
			acquireOn(t, r.s, "b", 1, 300*time.Millisecond, p)
			goneAfter(300 * time.Millisecond)

			acquireOn(t, r.s, "c", 2, 100*time.Millisecond, p)
			acquireOn(t, r.s, "d", 1, 2*time.Second, p)
			require.True(t, permitsOn(t, r.s, "d", 1, 500*time.Millisecond, p), "renewed before its lease ended")
			goneAfter(500 * time.Millisecond)

			acquireOn(t, r.s, "e", 2, time.Minute, p)
			acquireOn(t, r.s, "f", 1, 300*time.Millisecond, p)
			require.True(t, permitsOn(t, r.s, "e", 2, 0, p), "released")
			goneAfter(300 * time.Millisecond)
		})
	}
}

// TestPermitsInOneBatchSeeEachOther sends 8 Acquires of one permit of a
// plan of 5 as one batch: each decision sees the permits the ones before
// it took, so the first 5 are granted, with 4 to 0 left, and the rest
// refused; the set holds their 5 holders' members.
func TestPermitsInOneBatchSeeEachOther(t *testing.T) {
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			require.NotNil(t, r.s.batch, "the store batches by default")
			p := Plan{Name: "inflight", Capacity: 5, Concurrency: true}
			grants := make([]permit, 8)
			flush := batchOf(t, r.s, len(grants), func(i int) (Result, error) {
				grants[i] = permit{id: "h" + strconv.Itoa(i), lease: time.Minute, backs: &giveBacks{}}
				return r.s.decide(context.Background(), op{key: "k", n: 1, mode: modeAcquire, plans: []Plan{p}, grant: &grants[i]})
			})
			results, errs := flush()
			for i, res := range results {
				require.NoError(t, errs[i])
				assert.Equal(t, i < 5, res.Allowed, "decision %d", i)
				assert.Equal(t, i < 5, grants[i].store != nil, "decision %d names its store when granted", i)
				assert.Equal(t, max(4-int64(i), 0), res.Remaining, "decision %d", i)
			}
			members, err := r.s.client.ZRange(context.Background(), r.s.Key("k", p.Name), 0, -1).Result()
			require.NoError(t, err)
			assert.ElementsMatch(t, []string{"h0.1", "h1.1", "h2.1", "h3.1", "h4.1"}, members)
		})
	}
}

// TestBatchedAcquiresNeverHoldMoreThanCapacity has 32 goroutines Acquire
// one or two permits of a plan of 5 on one key and release them, through
// a RedisStore whose pool is smaller than its callers, so that decisions
// ride in batches. A holder counts its permits in once Acquire granted
// them and out before it releases them, which is at most what Redis held
// at any instant: never more than 5. Every Release succeeds.
func TestBatchedAcquiresNeverHoldMoreThanCapacity(t *testing.T) {
	ctx := context.Background()
	c, h := countedClient(t, &redis.Options{Addr: redistest.Addr(t), PoolSize: 4})
	s := fewSlots(NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())))
	require.NotNil(t, s.batch)
	l, err := New(s, []Plan{{Name: "inflight", Capacity: 5, Concurrency: true}}, WithLogger(nil),
		WithFailurePolicy(breaker.FailClosed))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })

	var held, most, acquires, granted atomic.Int64
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := range 40 {
				n := int64(1 + (g+i)%2)
				p, err := l.Acquire(ctx, "k", n, "inflight")
				acquires.Add(1)
				if !assert.NoError(t, err) || !p.OK() {
					continue
				}
				granted.Add(1)
				now := held.Add(n)
				for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
				}
				runtime.Gosched()
				held.Add(-n)
				assert.NoError(t, p.Release(ctx))
			}
		})
	}
	wg.Wait()
	t.Logf("%d acquires, %d granted, at most %d permits held; %d script calls", acquires.Load(), granted.Load(), most.Load(), h.alone.Load())
	assert.LessOrEqual(t, most.Load(), int64(5), "more permits held than the plan's capacity")
	assert.Positive(t, granted.Load())
	assert.Less(t, h.alone.Load(), acquires.Load()+granted.Load(), "some Acquires rode in batches")
	st := l.Stats().Permits
	assert.Equal(t, uint64(granted.Load()), st.Released)
	assert.Zero(t, st.Lost)
	assert.False(t, permitRedis{s: s}.exists(t, s.Key("k", "inflight")), "every permit released")
}

// TestPermitsOverALoweredCapacity: a key holds 5 permits of a plan whose
// capacity is then 3 (SetPlans, or instances with other plans): an
// Acquire is refused, with no permit free, not an error, alone or in a
// batch, in Redis as in a MemoryStore.
func TestPermitsOverALoweredCapacity(t *testing.T) {
	was := Plan{Name: "inflight", Capacity: 5, Concurrency: true}
	now := Plan{Name: "inflight", Capacity: 3, Concurrency: true}
	m := NewMemoryStore()
	acquireOn(t, m, "a", 5, time.Minute, was)
	want, err := m.decide(context.Background(), op{key: "k", n: 1, mode: modeAcquire, plans: []Plan{now}, grant: &permit{id: "b"}})
	require.NoError(t, err)
	assert.False(t, want.Allowed)
	assert.Zero(t, want.Remaining, "no permit free")
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			acquireOn(t, r.s, "a", 5, time.Minute, was)
			acquire := func(i int) (Result, error) {
				g := &permit{id: "b" + strconv.Itoa(i), lease: time.Minute, backs: &giveBacks{}}
				return r.s.decide(context.Background(), op{key: "k", n: 1, mode: modeAcquire, plans: []Plan{now}, grant: g})
			}
			alone, err := acquire(0)
			require.NoError(t, err)
			assert.Equal(t, want, alone)
			results, errs := batchOf(t, r.s, 2, acquire)()
			for i := range results {
				require.NoError(t, errs[i], "batched decision %d", i)
				assert.Equal(t, want, results[i], "batched decision %d", i)
			}
		})
	}
}

// scriptGate is a go-redis hook that, once armed, holds the first script
// call other than a permit.lua call (a release or renewal) until open is
// closed, and closes permitRan once a permit.lua call has run.
type scriptGate struct {
	permitSHA              string
	armed                  atomic.Bool
	held, open, permitRan  chan struct{}
	heldOnce, permitedOnce sync.Once
}

func newScriptGate(s *RedisStore) *scriptGate {
	return &scriptGate{permitSHA: s.permitScript.SHA(), held: make(chan struct{}),
		open: make(chan struct{}), permitRan: make(chan struct{})}
}

func (g *scriptGate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *scriptGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !isScriptCmd(cmd) || len(cmd.Args()) < 2 {
			return next(ctx, cmd)
		}
		if a := cmd.Args()[1]; a == g.permitSHA || a == permitScript {
			err := next(ctx, cmd)
			g.permitedOnce.Do(func() { close(g.permitRan) })
			return err
		}
		if g.armed.CompareAndSwap(true, false) {
			g.heldOnce.Do(func() { close(g.held) })
			<-g.open
		}
		return next(ctx, cmd)
	}
}

func (g *scriptGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestAcquireWithdrawnFromASentBatchStrandsNoPermit: an Acquire of the
// last permit rides a batch another caller sends, and its caller gives up
// while the batch is on its way to Redis. The batch grants the permit;
// the caller got its context's error, so nobody holds it, and the release
// by its holder id must reach Redis after the grant, not before: else the
// permit is held with no holder until its lease ends (before: 1 permit
// held of 1, and every Acquire refused, for the whole lease).
func TestAcquireWithdrawnFromASentBatchStrandsNoPermit(t *testing.T) {
	addrs := map[string]string{"miniredis": miniredis.RunT(t).Addr()}
	if redistest.Available() {
		addrs["redis"] = redistest.Addr(t)
	}
	for name, addr := range addrs {
		t.Run(name, func(t *testing.T) {
			c := redistest.NewClient(t, &redis.Options{Addr: addr})
			s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
			gate := newScriptGate(s)
			c.AddHook(gate)
			one := Plan{Name: "inflight", Capacity: 1, Concurrency: true}
			l, err := New(s, []Plan{one}, WithLogger(nil), WithFailurePolicy(breaker.FailClosed),
				WithPermitLease(time.Hour))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })

			ctx, cancel := context.WithCancel(context.Background())
			gaveUp := make(chan error, 1)
			flush := batchOf(t, s, 2, func(i int) (Result, error) {
				if i == 0 { // the leader, on another key
					p, err := l.Acquire(context.Background(), "other", 1, one.Name)
					return p.Result(), err
				}
				_, err := l.Acquire(ctx, "k", 1, one.Name)
				gaveUp <- err
				return Result{}, err
			})
			gate.armed.Store(true)
			flushed := make(chan struct{})
			go func() { defer close(flushed); flush() }()
			<-gate.held // the batch is on its way, with the Acquire of k in it
			cancel()
			require.ErrorIs(t, <-gaveUp, context.Canceled)
			select { // a release sent at once runs before the batch; one that waits, after
			case <-gate.permitRan:
			case <-time.After(time.Second):
			}
			close(gate.open)
			<-flushed
			l.backs.wait()

			n, err := c.ZCard(context.Background(), s.Key("k", one.Name)).Result()
			require.NoError(t, err)
			assert.Zero(t, n, "permits held with no holder")
			p, err := l.Acquire(context.Background(), "k", 1, one.Name)
			require.NoError(t, err)
			assert.True(t, p.OK(), "the permit of the caller who gave up is free")
		})
	}
}

// replyDropper is a go-redis hook whose connections, once armed, lose the
// reply to the next script call they carry: Redis runs it, and the read
// of its reply fails with io.EOF, as when a connection drops between the
// two, which go-redis retries on another connection.
type replyDropper struct{ armed atomic.Bool }

func (d *replyDropper) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := next(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &droppingConn{Conn: c, d: d}, nil
	}
}

func (d *replyDropper) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (d *replyDropper) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// droppingConn is a connection of a replyDropper.
type droppingConn struct {
	net.Conn
	d    *replyDropper
	drop bool // the reply to what was written is to be lost
}

func (c *droppingConn) Write(b []byte) (int, error) {
	s := bytes.ToLower(b)
	if (bytes.Contains(s, []byte("evalsha")) || bytes.Contains(s, []byte("fcall"))) && c.d.armed.CompareAndSwap(true, false) {
		c.drop = true
	}
	return c.Conn.Write(b)
}

func (c *droppingConn) Read(b []byte) (int, error) {
	if !c.drop {
		return c.Conn.Read(b)
	}
	_, err := c.Conn.Read(b) // the reply: Redis ran the call
	_ = c.Conn.Close()
	if err != nil {
		return 0, err
	}
	return 0, io.EOF
}

// TestAcquireRetriedByTheClientStrandsNoPermit: the connection drops
// after Redis ran an Acquire, and go-redis, as it does on io.EOF, runs the
// call again on another connection. The call that ran holds the permit
// under the holder's id; the retry must see the holder's own permit, not
// a rival's, and take nothing more. Else, of the only permit, it is
// refused, no error comes back to release it by its id, and the permit is
// held by nobody for its whole lease, every Acquire refused; and with a
// permit to spare, a bucket chained with it gives its token twice.
func TestAcquireRetriedByTheClientStrandsNoPermit(t *testing.T) {
	addrs := map[string]string{"miniredis": miniredis.RunT(t).Addr()}
	if redistest.Available() {
		addrs["redis"] = redistest.Addr(t)
	}
	rate := Plan{Name: "rate", Capacity: 10, Rate: 0.001}
	for name, addr := range addrs {
		for _, capacity := range []int64{1, 2} {
			t.Run(fmt.Sprintf("%s/capacity-%d", name, capacity), func(t *testing.T) {
				ctx := context.Background()
				c := redistest.NewClient(t, &redis.Options{Addr: addr})
				drop := &replyDropper{}
				c.AddHook(drop)
				s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
				inflight := Plan{Name: "inflight", Capacity: capacity, Concurrency: true}
				l, err := New(s, []Plan{inflight, rate}, WithLogger(nil), WithFailurePolicy(breaker.FailClosed),
					WithPermitLease(time.Hour))
				require.NoError(t, err)
				t.Cleanup(func() { _ = l.Close() })
				p, err := l.Acquire(ctx, "warm", 1, inflight.Name) // loads the scripts
				require.NoError(t, err)
				require.NoError(t, p.Release(ctx))

				drop.armed.Store(true)
				p, err = l.Acquire(ctx, "k", 1, inflight.Name, rate.Name)
				require.NoError(t, err)
				assert.False(t, drop.armed.Load(), "a reply was lost")
				assert.True(t, p.OK(), "a permit was free, and the retry found its holder's own")
				assert.Equal(t, capacity-1, p.Result().Remaining)
				if p.OK() {
					require.NoError(t, p.Release(ctx))
				}
				n, err := c.ZCard(ctx, s.Key("k", inflight.Name)).Result()
				require.NoError(t, err)
				assert.Zero(t, n, "permits held with no holder")
				r, err := l.Peek(ctx, "k", rate.Name)
				require.NoError(t, err)
				assert.Equal(t, int64(9), r.Remaining, "the bucket's token taken once")
			})
		}
	}
}
