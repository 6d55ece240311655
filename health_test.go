package tollgate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestClusterBreakerPerMaster kills one master of a 3-master Cluster under
// decisions on keys of every master, for longer than the Cluster takes to
// mark it failed. Its keys go to the fallback once its breaker trips; the
// other masters' keys stay on Redis, each decision of them: a breaker per
// Limiter sent them all to the fallback (issue 14).
func TestClusterBreakerPerMaster(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	cl := redistest.StartCluster(t, 3, 0)
	ff := redistest.FailFast("")
	client := cl.Client(t, &redis.ClusterOptions{
		DialTimeout: ff.DialTimeout, ReadTimeout: ff.ReadTimeout, WriteTimeout: ff.WriteTimeout,
		PoolTimeout: ff.PoolTimeout, DialerRetries: ff.DialerRetries, MaxRetries: -1, MaxRedirects: -1,
		ContextTimeoutEnabled: true,
	})
	logs := &logCounter{}
	l, err := New(NewRedisStore(client, WithKeyPrefix(redistest.KeyPrefix())), []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}},
		WithDenialCache(0), WithLogger(slog.New(logs)), WithBreaker(breaker.Settings{Failures: 3, Cooldown: time.Minute}))
	require.NoError(t, err)
	ctx := context.Background()

	byMaster := map[string][]string{} // master address → keys it serves
	for i := 0; len(byMaster) < 3 || minLen(byMaster) < 5; i++ {
		key := fmt.Sprint("user-", i)
		addr := cl.MasterFor(key).Addr()
		byMaster[addr] = append(byMaster[addr], key)
	}
	for _, keys := range byMaster {
		for _, key := range keys {
			r, err := l.Allow(ctx, key)
			require.NoError(t, err)
			require.Equal(t, SourceStore, r.Source)
		}
	}
	// By default a Cluster refuses every command (CLUSTERDOWN) once a
	// master is marked failed and until a replica takes over; with this
	// setting the other masters go on serving their slots.
	for _, addr := range cl.Addrs() {
		c := redis.NewClient(&redis.Options{Addr: addr})
		require.NoError(t, c.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err())
		_ = c.Close()
	}
	victim := cl.MasterFor(byMaster[cl.Addrs()[0]][0])
	victim.Kill()
	killed := time.Now()

	sources := map[string]map[Source]int{} // master address → sources of its keys' decisions
	rounds := 0
	// Past the Cluster's node timeout (1 s), when it marks the master failed.
	for ; rounds < 20 || time.Since(killed) < 1500*time.Millisecond; rounds++ {
		for addr, keys := range byMaster {
			if sources[addr] == nil {
				sources[addr] = map[Source]int{}
			}
			for _, key := range keys {
				r, err := l.Allow(ctx, key)
				require.NoError(t, err, "breaker.Fallback decides while a master is down")
				sources[addr][r.Source]++
			}
		}
	}
	t.Logf("sources by master (victim %s): %v", victim.Addr(), sources)
	for addr, src := range sources {
		if addr == victim.Addr() {
			assert.Positive(t, src[SourceFallback], "the dead master's keys go to the fallback")
			continue
		}
		assert.Zero(t, src[SourceFallback], "master %s is healthy: its keys stay on Redis", addr)
		assert.Equal(t, rounds*len(byMaster[addr]), src[SourceStore], "master %s", addr)
	}
	s := l.Stats()
	assert.Equal(t, breaker.Open, s.Breaker, "the dead master's breaker")
	assert.Equal(t, uint64(1), s.BreakerOpened, "one trip, of one master's breaker")
	assert.True(t, s.Outage)
	assert.Len(t, logs.levels, 1, "one line for the outage")
}

func minLen(m map[string][]string) int {
	n := -1
	for _, v := range m {
		if n < 0 || len(v) < n {
			n = len(v)
		}
	}
	return n
}

// movingMasterStore is a store spread over masters, whose master of every
// key is master, "" when the client cannot name it, and whose calls fail
// while down.
type movingMasterStore struct {
	mem    *MemoryStore
	master atomic.Pointer[string]
	down   atomic.Bool
}

func (s *movingMasterStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if s.down.Load() {
		return Result{}, errors.New("connection refused")
	}
	return s.mem.Take(ctx, key, cost, plans)
}

func (s *movingMasterStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return s.mem.Reset(ctx, key, plans)
}

func (s *movingMasterStore) spread() bool { return true }

func (s *movingMasterStore) masterOf(context.Context, string, string) (string, error) {
	if m := *s.master.Load(); m != "" {
		return m, nil
	}
	return "", errors.New("slot map not loaded")
}

// TestOutageEndsWhenItsMasterIsGone: a Cluster master dies, its breaker
// trips, and a replica at another address takes over its slots (or the
// client, which could not name a master during the outage, can again).
// No decision asks the dead master's breaker again, so it stays open: the
// outage must end all the same once the store answers, or Stats().Outage,
// Stats().Breaker and the metrics built on them say "outage" for ever.
func TestOutageEndsWhenItsMasterIsGone(t *testing.T) {
	for name, dead := range map[string]string{"failover": "10.0.0.1:6379", "unnamed": ""} {
		t.Run(name, func(t *testing.T) {
			s := &movingMasterStore{mem: NewMemoryStore()}
			s.master.Store(&dead)
			s.down.Store(true)
			l, err := New(s, []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}}, WithDenialCache(0),
				WithLogger(slog.New(&logCounter{})), WithBreaker(breaker.Settings{Cooldown: 10 * time.Millisecond, Window: 100 * time.Millisecond}))
			require.NoError(t, err)
			ctx := context.Background()
			for range 3 {
				_, err := l.Allow(ctx, "k")
				require.NoError(t, err)
			}
			require.True(t, l.Stats().Outage)
			require.Equal(t, breaker.Open, l.Stats().Breaker)

			promoted := "10.0.0.2:6379"
			s.master.Store(&promoted)
			s.down.Store(false)
			require.Eventually(t, func() bool {
				r, err := l.Allow(ctx, "k")
				st := l.Stats()
				return err == nil && r.Source == SourceStore && !st.Outage && st.Breaker == breaker.Closed
			}, 3*time.Second, 5*time.Millisecond, "the outage never ends: %+v", l.Stats().Breaker)
			assert.Equal(t, uint64(1), l.Stats().BreakerOpened, "the trip is still counted")
		})
	}
}

// hungMasterStore is a store spread over two masters: keys starting with
// "hung" live on A, which answers nothing (a call waits until its
// caller's context ends, and returns the context's error, as go-redis
// does with ContextTimeoutEnabled), and the others on B, which is healthy.
type hungMasterStore struct{ mem *MemoryStore }

func (s hungMasterStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if strings.HasPrefix(key, "hung") {
		<-ctx.Done()
		return Result{}, ctx.Err()
	}
	return s.mem.Take(ctx, key, cost, plans)
}

func (s hungMasterStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return s.mem.Reset(ctx, key, plans)
}

func (s hungMasterStore) spread() bool { return true }

func (s hungMasterStore) masterOf(_ context.Context, key, _ string) (string, error) {
	if strings.HasPrefix(key, "hung") {
		return "A", nil
	}
	return "B", nil
}

// TestHungMasterTripsItsBreakerForImpatientCallers: a Cluster master that
// hangs behind callers whose deadlines are shorter than its client's
// timeouts answers nobody, and once it has for a cooldown its calls count
// against it, as a hung standalone Redis's do: its breaker trips. Another
// master's answers tell nothing of this one; were they counted, the hung
// master's breaker never heard a failure, and every call of its keys
// waited out its caller's whole deadline for good.
func TestHungMasterTripsItsBreakerForImpatientCallers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l, err := New(hungMasterStore{NewMemoryStore()}, []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}},
			WithLogger(nil), WithDenialCache(0), WithBreaker(breaker.Settings{Cooldown: 50 * time.Millisecond}))
		require.NoError(t, err)
		for range 100 {
			r, err := l.Allow(context.Background(), "healthy")
			require.NoError(t, err)
			require.Equal(t, SourceStore, r.Source, "the healthy master's keys stay on Redis")
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
			_, _ = l.Allow(ctx, "hung")
			cancel()
		}
		st := l.Stats()
		assert.Equal(t, uint64(1), st.BreakerOpened, "the hung master's breaker trips, once")
		assert.Equal(t, breaker.Open, st.Breaker)
	})
}

// TestNewMasterIsNotSilentAtOnce: a master first asked long after the
// Limiter began (a replica promoted by a failover, or a master whose keys
// were not asked before) has not been silent for a cooldown: its first
// calls cut short by their callers are the callers' doing, not failures.
func TestNewMasterIsNotSilentAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const cooldown = 50 * time.Millisecond
		l, err := New(hungMasterStore{NewMemoryStore()}, []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}},
			WithLogger(nil), WithDenialCache(0), WithBreaker(breaker.Settings{Failures: 3, Cooldown: cooldown}))
		require.NoError(t, err)
		time.Sleep(2 * cooldown)
		for range 3 {
			ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
			_, err := l.Allow(ctx, "hung")
			cancel()
			require.ErrorIs(t, err, context.DeadlineExceeded)
		}
		assert.Zero(t, l.Stats().BreakerOpened, "3 impatient callers are no outage")
	})
}
