package tollgate

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestHoldTimedOutIsGivenBackOnRealRedis: Redis stalls 150 ms, longer than
// README's client settings wait for a reply (ReadTimeout 100 ms), while a
// caller with a 40 ms deadline asks for a token under a plan of capacity
// 100 that leases 20, or reserves 20; five times. Each hold's script call
// fails on the client, yet runs once Redis wakes, taking the tokens and
// setting the hold. Nobody is admitted, so once the Limiter is closed and
// the holds given back, the bucket holds what was due (at least 95 of
// 100), and never more than its capacity. Batched, 8 keys at once.
func TestHoldTimedOutIsGivenBackOnRealRedis(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	srv := redistest.StartServer(t)
	// A rate slow enough that the bucket gains no whole token while the
	// test runs: only a give-back brings tokens back.
	plan := Plan{Name: "hot", Capacity: 100, Rate: 0.001, Lease: 20}
	for _, tc := range []struct {
		name    string
		reserve bool
		keys    int
		opts    []Option
	}{
		{"lease", false, 1, []Option{WithoutBatching()}},
		{"lease/batched", false, 8, nil},
		{"reserve", true, 1, []Option{WithoutBatching()}},
		{"reserve/batched", true, 8, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := append([]Option{WithKeyPrefix(redistest.KeyPrefix())}, tc.opts...)
			rs := fewSlots(NewRedisStore(redistest.NewClient(t, redistest.FailFast(srv.Addr())), opts...))
			p := plan
			if tc.reserve {
				p.Lease = 0
			}
			l, err := New(rs, []Plan{p}, WithLogger(nil), WithDenialCache(0))
			require.NoError(t, err)
			for k := range tc.keys { // a connection or more, before Redis stalls
				_, err := l.Peek(context.Background(), fmt.Sprint("k", k))
				require.NoError(t, err)
			}
			admitted := stallFiveTimes(t, srv, tc.keys, func(ctx context.Context, key string) bool {
				if tc.reserve {
					rv, err := l.Reserve(ctx, key, 20)
					return err == nil && rv.Result().Allowed && rv.Result().Source == SourceStore
				}
				r, err := l.Allow(ctx, key)
				return err == nil && r.Allowed && (r.Source == SourceStore || r.Source == SourceLease)
			})
			require.NoError(t, l.Close())
			peek := bucketReader(t, rs, p)
			left := make([]int64, tc.keys)
			assert.Eventually(t, func() bool {
				for k := range tc.keys {
					if left[k] = peek(fmt.Sprint("k", k)); left[k] < p.Capacity-5 {
						return false
					}
				}
				return true
			}, 20*time.Second, 10*time.Millisecond, "at least %d of %d due back", p.Capacity-5, p.Capacity)
			for k := range tc.keys {
				assert.GreaterOrEqual(t, left[k], p.Capacity-5, "key %d: %d admitted", k, admitted[k])
				assert.LessOrEqual(t, peek(fmt.Sprint("k", k)), p.Capacity-admitted[k], "key %d: nothing minted", k)
			}
		})
	}
}

// stallFiveTimes stops srv for 150 ms five times, while a caller with a
// 40 ms deadline on each of keys keys calls ask, and returns how many
// each key's callers were admitted (ask's report).
func stallFiveTimes(t *testing.T, srv *redistest.Server, keys int, ask func(ctx context.Context, key string) bool) []int64 {
	t.Helper()
	admitted := make([]int64, keys)
	for range 5 {
		srv.Signal(syscall.SIGSTOP)
		var wg sync.WaitGroup
		var mu sync.Mutex
		for k := range keys {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 40*time.Millisecond)
				defer cancel()
				if ask(ctx, fmt.Sprint("k", k)) {
					mu.Lock()
					admitted[k]++
					mu.Unlock()
				}
			})
		}
		time.Sleep(150 * time.Millisecond)
		srv.Signal(syscall.SIGCONT)
		wg.Wait()
	}
	return admitted
}

// bucketReader returns a function that reads the bucket of a key under
// plan p, without a lease, in rs.
func bucketReader(t *testing.T, rs *RedisStore, p Plan) func(key string) int64 {
	t.Helper()
	p.Lease = 0
	l, err := New(rs, []Plan{p}, WithDenialCache(0), WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return func(key string) int64 {
		r, err := l.Peek(context.Background(), key)
		require.NoError(t, err)
		return r.Remaining
	}
}

// lostReplyHook loses the reply of the next call of one script, sha, once
// armed: the call fails with a read timeout, and runs in Redis either
// first (ranFirst) or only once ready reports true (or after 5 s, if
// nothing makes it true), as a call that Redis reads late runs after what
// was sent after it.
type lostReplyHook struct {
	sha      string
	ranFirst bool
	ready    func() bool
	armed    atomic.Bool
	late     sync.WaitGroup
}

func (h *lostReplyHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *lostReplyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "evalsha" || cmd.Args()[1] != h.sha || !h.armed.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		lost := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
		if h.ranFirst {
			_ = next(ctx, cmd)
			return lost
		}
		h.late.Go(func() {
			for end := time.Now().Add(5 * time.Second); !h.ready() && time.Now().Before(end); {
				time.Sleep(time.Millisecond)
			}
			_ = next(context.Background(), cmd)
		})
		return lost
	}
}

func (h *lostReplyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestHoldWhoseReplyIsLostIsGivenBack: a hold's call fails with a read
// timeout while its script runs in Redis, before the give-back or after
// it. Either way the hold's tokens come back once: the bucket is full
// again, and tokens taken after it are not refunded twice.
func TestHoldWhoseReplyIsLostIsGivenBack(t *testing.T) {
	for _, ranFirst := range []bool{true, false} {
		t.Run(fmt.Sprint("ranFirst=", ranFirst), func(t *testing.T) {
			ctx := context.Background()
			mr := miniredis.RunT(t)
			mr.SetTime(time.UnixMicro(t0))
			c := redistest.NewClient(t, &redis.Options{Addr: mr.Addr(), MaxRetries: -1})
			rs := NewRedisStore(c)
			hook := &lostReplyHook{sha: rs.scripts.limit.SHA(), ranFirst: ranFirst}
			c.AddHook(hook)
			plans := []Plan{{Name: "p", Capacity: 100, Rate: 1}}
			left := func() int64 {
				r, err := rs.take(ctx, "k", 0, plans)
				require.NoError(t, err)
				return r.Remaining
			}
			require.Equal(t, int64(100), left()) // loads the script
			h := hold{ttl: time.Minute}
			hook.ready = func() bool { return mr.Exists(rs.Key("k", "~"+h.id)) } // the give-back's tombstone
			hook.armed.Store(true)
			_, err := rs.hold(ctx, "k", 20, plans, &h)
			require.Error(t, err)
			hook.late.Wait()
			require.Eventually(t, func() bool {
				tomb, err := mr.Get(rs.Key("k", "~"+h.id))
				return err == nil && tomb == "s"
			}, 10*time.Second, time.Millisecond, "the give-back lands, and leaves its tombstone")
			assert.Equal(t, int64(100), left(), "the hold's 20 came back")
			_, err = rs.take(ctx, "k", 30, plans)
			require.NoError(t, err)
			_, status, err := rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &h, n: 20})
			require.NoError(t, err)
			assert.Equal(t, holdSettled, status)
			assert.Equal(t, int64(70), left(), "given back once")
		})
	}
}

// TestMayHaveRun: only an error Redis answered, or one before anything
// was sent, proves that a hold's script did not run, and will not.
func TestMayHaveRun(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&redisscript.Error{Class: "OOM"}, false},
		{fmt.Errorf("wrapped: %w", &redisscript.Error{Class: "READONLY"}), false},
		{redis.ErrPoolTimeout, false},
		{redis.ErrClosed, false},
		{&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("refused")}, false},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{&net.OpError{Op: "write", Net: "tcp", Err: errors.New("reset")}, true},
		{os.ErrDeadlineExceeded, true},
		{context.DeadlineExceeded, true},
		{context.Canceled, true},
		{redisscript.ErrBadReply, true},
	} {
		assert.Equal(t, tc.want, mayHaveRun(tc.err), "%v", tc.err)
	}
}
