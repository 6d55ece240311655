package tollgate

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
)

// settleHook holds back each call of the settle script for delay, then
// fails it without running it while fails is above 0, as a read that
// timed out.
type settleHook struct {
	sha   string
	delay time.Duration
	fails atomic.Int32
	calls atomic.Int32
}

func (h *settleHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *settleHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "evalsha" || cmd.Args()[1] != h.sha {
			return next(ctx, cmd)
		}
		h.calls.Add(1)
		time.Sleep(h.delay)
		if h.fails.Add(-1) >= 0 {
			return &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
		}
		return next(ctx, cmd)
	}
}

func (h *settleHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// withSettleHook adds a settleHook to the client of rs, newStalledStore's,
// with the settle script loaded so that each settlement is one EVALSHA.
func withSettleHook(t *testing.T, rs *RedisStore) *settleHook {
	t.Helper()
	c := rs.client.(*redis.Client)
	require.NoError(t, c.ScriptLoad(context.Background(), settleScript).Err())
	h := &settleHook{sha: rs.settleScript.SHA()}
	c.AddHook(h)
	return h
}

// TestGiveBackOutlastsAFailingStore: the first settlement of a lease's
// rest fails, as a read that timed out (the store's failure) or one that
// timed out far past the client's timeouts (this process's stall). The
// give-back is not the failure policy's to answer, whichever it is: it
// is tried again, and the rest comes back. Before, the Fallback policy
// dropped the refund, FailOpen settled nothing, and FailClosed's error
// was not retried: 80 of 100 left.
func TestGiveBackOutlastsAFailingStore(t *testing.T) {
	plan := leasedPlan
	plan.Lease = 20
	for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailOpen, breaker.FailClosed} {
		for _, stall := range []bool{false, true} {
			name := policy.String() + "/error"
			if stall {
				name = policy.String() + "/stall"
			}
			t.Run(name, func(t *testing.T) {
				rs, _ := newStalledStore(t)
				hook := withSettleHook(t, rs)
				l, err := New(rs, []Plan{plan}, WithLogger(nil), WithDenialCache(0), WithFailurePolicy(policy))
				require.NoError(t, err)
				r, err := l.Allow(context.Background(), "k")
				require.NoError(t, err)
				require.Equal(t, SourceStore, r.Source, "a lease of 20 taken, 1 handed out")
				if stall { // past what the client's timeouts allow a call
					hook.delay = rs.callBudget() + 50*time.Millisecond
				}
				hook.fails.Store(1)
				require.NoError(t, l.Close())
				assert.Equal(t, int32(2), hook.calls.Load(), "tried, and tried again")
				assert.Equal(t, plan.Capacity-1, remaining(t, rs, "k"), "the lease's rest came back")
				if stall {
					assert.Equal(t, uint64(1), l.Stats().StoreErrors["stalled"], "the stall rule judged it")
				}
				st := l.Stats().Reservations
				assert.Equal(t, [2]uint64{1, 1}, [2]uint64{st.Held, st.Settled}, "held and settled")
			})
		}
	}
}

// TestCloseWaitsForGiveBacks: Close returns once what the Limiter gives
// back is back in Redis: the hold of a Reserve whose caller left while
// Redis ran it, and the hold of a lease whose reply was lost, given back
// by its id, here late. Before, Close did not wait for either, and the
// bucket read just after it held 80 of 100.
func TestCloseWaitsForGiveBacks(t *testing.T) {
	t.Run("reserve whose caller left", func(t *testing.T) {
		rs, stall := newStalledStore(t)
		plain := leasedPlan
		plain.Lease = 0
		l, err := New(rs, []Plan{plain}, WithLogger(nil), WithDenialCache(0))
		require.NoError(t, err)
		stall.on.Store(true)
		ctx, cancel := context.WithTimeout(context.Background(), 40*time.Millisecond)
		defer cancel()
		_, err = l.Reserve(ctx, "k", 20)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		stall.on.Store(false) // the hold's reply is still held back
		require.NoError(t, l.Close())
		assert.Equal(t, plain.Capacity, remaining(t, rs, "k"))
	})
	t.Run("lease whose reply was lost", func(t *testing.T) {
		rs, _ := newStalledStore(t)
		slow := withSettleHook(t, rs)
		slow.delay = 100 * time.Millisecond
		plan := leasedPlan
		plan.Lease = 20
		l, err := New(rs, []Plan{plan}, WithLogger(nil), WithDenialCache(0), WithFailurePolicy(breaker.FailClosed))
		require.NoError(t, err)
		_, err = l.Peek(context.Background(), "k") // loads the limit script: the hold is one EVALSHA
		require.NoError(t, err)
		lost := &lostReplyHook{sha: rs.scripts.limit.SHA(), ranFirst: true}
		lost.armed.Store(true)
		rs.client.(*redis.Client).AddHook(lost)
		_, err = l.Allow(context.Background(), "k")
		require.ErrorIs(t, err, ErrStoreUnavailable, "the lease's hold ran, and its reply was lost")
		require.NoError(t, l.Close())
		assert.Equal(t, plan.Capacity, remaining(t, rs, "k"))
	})
}
