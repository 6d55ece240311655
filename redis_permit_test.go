package tollgate

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

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
