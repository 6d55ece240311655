package tollgate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
)

// stallHook holds back the reply of every script call while on, after
// Redis ran it: a stalled Redis that answers late. A caller whose context
// ends first gets its context's error, and the reply is lost to it.
// A script Redis does not know yet (NOSCRIPT) is not held back.
type stallHook struct {
	on    atomic.Bool
	stall time.Duration
}

func (h *stallHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *stallHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && isScriptCmd(cmd) && h.on.Load() {
			t := time.NewTimer(h.stall)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return err
	}
}

func (h *stallHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// newStalledStore returns a RedisStore on miniredis, whose clock stands
// still, behind README's client settings and a stallHook of 150 ms,
// batching unless opts say otherwise, on few call slots.
func newStalledStore(t *testing.T, opts ...Option) (*RedisStore, *stallHook) {
	t.Helper()
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{
		Addr:        mr.Addr(),
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond,
		WriteTimeout: 100 * time.Millisecond, PoolTimeout: 100 * time.Millisecond,
		MaxRetries: -1, DialerRetries: 1, ContextTimeoutEnabled: true,
	})
	t.Cleanup(func() { _ = c.Close() })
	hook := &stallHook{stall: 150 * time.Millisecond}
	c.AddHook(hook)
	return fewSlots(NewRedisStore(c, opts...)), hook
}

// TestLeaseTakeOutlivesItsCaller: callers with a 40 ms deadline ask for a
// token while Redis answers in 150 ms, so each gives up while a lease of
// 20 is being taken. A lease taken for a caller who left is kept as the
// key's lease or given back: after Close, every token not admitted is in
// the bucket. Batched, 8 keys at once, so that most takes go in batches.
//
// Under FailClosed every admission is Redis's, so the bucket holds
// exactly what was not admitted. Under Fallback a starved process (the
// stall rule, or a breaker tripped by reads it was too slow to make)
// admits from the fallback, which takes nothing from Redis, and sends a
// key whose lease the fallback granted to Redis one request at a time,
// where a take whose caller left keeps its token: there, only what Redis
// admitted counts, and the bucket never holds more than it left.
func TestLeaseTakeOutlivesItsCaller(t *testing.T) {
	plan := leasedPlan
	plan.Lease = 20
	for _, tc := range []struct {
		name string
		keys int
		opts []Option
	}{
		{"alone", 1, []Option{WithoutBatching()}},
		{"alone8", 8, []Option{WithoutBatching()}},
		{"batched", 8, nil},
	} {
		for _, policy := range []breaker.FailurePolicy{breaker.FailClosed, breaker.Fallback} {
			t.Run(tc.name+"/"+policy.String(), func(t *testing.T) {
				rs, hook := newStalledStore(t, tc.opts...)
				l, err := New(rs, []Plan{plan}, WithLogger(nil), WithDenialCache(0), WithFailurePolicy(policy))
				require.NoError(t, err)
				hook.on.Store(true)
				admitted := askWhileStalled(t, l, tc.keys)
				hook.on.Store(false)
				require.NoError(t, l.Close())
				for k := range tc.keys {
					left := remaining(t, rs, fmt.Sprint("k", k))
					if policy == breaker.FailClosed {
						assert.Equal(t, plan.Capacity-admitted[k], left, "key %d: %d admitted; the rest is due back", k, admitted[k])
					} else {
						assert.LessOrEqual(t, left, plan.Capacity-admitted[k], "key %d: %d admitted by Redis; nothing minted", k, admitted[k])
					}
				}
			})
		}
	}
}

// askWhileStalled has a caller with a 40 ms deadline ask l for a token of
// each of keys keys at once, five times, and returns how many of each
// key's were admitted with tokens of Redis: by the store or a lease. A
// caller that is not admitted gets its deadline's error, or under
// FailClosed ErrStoreUnavailable.
func askWhileStalled(t *testing.T, l *Limiter, keys int) []int64 {
	t.Helper()
	admitted := make([]atomic.Int64, keys)
	for range 5 {
		var wg sync.WaitGroup
		for k := range keys {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 40*time.Millisecond)
				defer cancel()
				r, err := l.Allow(ctx, fmt.Sprint("k", k))
				if err != nil {
					if !errors.Is(err, ErrStoreUnavailable) {
						assert.ErrorIs(t, err, context.DeadlineExceeded)
					}
					return
				}
				if r.Allowed && (r.Source == SourceStore || r.Source == SourceLease) {
					admitted[k].Add(1)
				}
			})
		}
		wg.Wait()
	}
	n := make([]int64, keys)
	for k := range n {
		n[k] = admitted[k].Load()
	}
	return n
}

// TestReserveOutlivesItsCaller: a Reserve whose caller gives up while
// Redis takes the hold gets its context's error, and the hold is given
// back, not left in Redis with its tokens.
func TestReserveOutlivesItsCaller(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"alone", []Option{WithoutBatching()}},
		{"batched", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs, hook := newStalledStore(t, tc.opts...)
			plain := leasedPlan
			plain.Lease = 0
			l, err := New(rs, []Plan{plain}, WithLogger(nil), WithDenialCache(0))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			hook.on.Store(true)
			var wg sync.WaitGroup
			for range 4 {
				wg.Go(func() {
					ctx, cancel := context.WithTimeout(context.Background(), 40*time.Millisecond)
					defer cancel()
					_, err := l.Reserve(ctx, "k", 10)
					assert.ErrorIs(t, err, context.DeadlineExceeded)
				})
			}
			wg.Wait()
			hook.on.Store(false)
			require.Eventually(t, func() bool {
				st := l.Stats().Reservations
				return st.Held == 4 && st.Settled == 4
			}, 10*time.Second, time.Millisecond, "every hold taken for a caller who left is counted and given back")
			assert.Equal(t, plain.Capacity, remaining(t, rs, "k"))
		})
	}
}
