package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestRefundWhoseReplyIsLostForgetsRememberedDenials: a settlement's
// refund runs in Redis, and its reply is lost. The Limiter cannot tell
// whether the refund landed, so it forgets the key's remembered denials
// as for a refund it saw: the next request is asked of Redis, which
// holds the refunded tokens. Under the Fallback policy the Settle is
// answered by the fallback (Refunded 0); under FailClosed it fails, and
// its retry finds the hold settled (ErrNotHeld).
func TestRefundWhoseReplyIsLostForgetsRememberedDenials(t *testing.T) {
	for name, addr := range lostReplyServers() {
		for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailClosed} {
			t.Run(name+"/"+policy.String(), func(t *testing.T) {
				testRefundWhoseReplyIsLost(t, addr(t), policy)
			})
		}
	}
}

// lostReplyServers returns the Redis servers a test of a lost reply
// runs on, each started for the test that asks for its address:
// miniredis, and a real Redis if one is reachable.
func lostReplyServers() map[string]func(*testing.T) string {
	return map[string]func(*testing.T) string{
		"miniredis": func(t *testing.T) string {
			mr := miniredis.RunT(t)
			mr.SetTime(time.UnixMicro(t0))
			return mr.Addr()
		},
		"redis": func(t *testing.T) string { return redistest.Addr(t) },
	}
}

func testRefundWhoseReplyIsLost(t *testing.T, addr string, policy breaker.FailurePolicy) {
	ctx := context.Background()
	c := redistest.NewClient(t, &redis.Options{Addr: addr, MaxRetries: -1})
	rs := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	l, err := New(rs, []Plan{llm}, WithLogger(nil), WithDenialCache(100), WithFailurePolicy(policy))
	require.NoError(t, err)
	warm, err := l.Reserve(ctx, "other", 1) // loads the settle script: the refund is one EVALSHA
	require.NoError(t, err)
	_, err = warm.Cancel(ctx)
	require.NoError(t, err)

	r := reserveAllAndRemember(t, l, "k")

	lost := &lostReplyHook{sha: rs.settleScript.SHA(), ranFirst: true}
	lost.armed.Store(true)
	c.AddHook(lost)
	_, err = r.Settle(ctx, 500)
	if policy == breaker.FailClosed {
		require.ErrorIs(t, err, ErrStoreUnavailable)
		_, err = r.Settle(ctx, 500)
		require.ErrorIs(t, err, ErrNotHeld, "the first try refunded")
	} else {
		require.NoError(t, err)
	}
	p, err := l.PeekN(ctx, "k", 10)
	require.NoError(t, err)
	require.True(t, p.Allowed, "Redis holds the refund")
	a, err := l.AllowN(ctx, "k", 10)
	require.NoError(t, err)
	assert.True(t, a.Allowed, "the refund whose reply was lost is seen at once; source %v, RetryAfter %v", a.Source, a.RetryAfter)
}

// refundAcrossVersion is a reservation's refund across a plan change:
// plan "p", version 1, capacity 100, 1 token an hour; AllowN(40) leaves
// 60, Reserve(50) leaves 10; then SetPlans installs next and the
// reservation is cancelled. without is what the bucket would hold had
// the reservation never taken its 50; refunded is the refund, in the new
// version's tokens, and after what the key admits once it landed.
type refundAcrossVersion struct {
	name     string
	next     Plan
	without  int64
	refunded int64
	after    int64
}

// hourly is plan "p" at version, of capacity tokens refilled at 1 an hour.
func hourly(version uint32, capacity int64, how Inheritance) Plan {
	return Plan{Name: "p", Capacity: capacity, Rate: 1.0 / 3600, Version: version, Inherit: how}
}

// TestRefundAcrossAVersionNeverMints: a refund never gives back more than
// the bucket would hold had the reservation never taken it. A
// proportional change scales the tokens left, and the refund alike
// (60 × 50/100 = 30, not 10 × 50/100 + 50 = 50); an as-is or additive
// change carries the tokens 1:1, and the refund with them, exactly. A
// proportional upgrade refunds what was reserved, unscaled: less than
// exact, never more.
func TestRefundAcrossAVersionNeverMints(t *testing.T) {
	for _, tt := range []refundAcrossVersion{
		{"proportional downgrade", hourly(2, 50, InheritProportional), 30, 25, 30},
		{"proportional upgrade", hourly(2, 200, InheritProportional), 120, 50, 70},
		{"as-is downgrade", hourly(2, 50, 0), 50, 50, 50},
		{"as-is upgrade", hourly(2, 200, 0), 60, 50, 60},
		{"additive downgrade", hourly(2, 50, InheritAdditive), 50, 50, 50},
		{"additive upgrade", hourly(2, 200, InheritAdditive), 160, 50, 160},
	} {
		t.Run(tt.name, func(t *testing.T) {
			eachStore(t, []Plan{hourly(1, 100, 0)}, func(t *testing.T, l clockedLimiter) {
				testRefundAcrossVersion(t, l.Limiter, tt)
			}, WithDenialCache(0))
		})
	}
}

func testRefundAcrossVersion(t *testing.T, l *Limiter, tt refundAcrossVersion) {
	ctx := context.Background()
	a, err := l.AllowN(ctx, "k", 40)
	require.NoError(t, err)
	require.Equal(t, int64(60), a.Remaining)
	r, err := l.Reserve(ctx, "k", 50)
	require.NoError(t, err)
	require.Equal(t, int64(10), r.Result().Remaining)
	require.NoError(t, l.SetPlans([]Plan{tt.next}))
	st, err := r.Cancel(ctx)
	require.NoError(t, err)
	after := admittedNow(t, l, "k")
	t.Logf("refunded %d, %d admitted after, %d without the reservation", st.Refunded, after, tt.without)
	assert.LessOrEqual(t, after, tt.without, "admitted after the refund, of what the bucket would hold without the reservation")
	assert.Equal(t, tt.refunded, st.Refunded)
	assert.Equal(t, tt.after, after)
}

// admittedNow counts the tokens key admits, one by one, at one instant.
func admittedNow(t *testing.T, l *Limiter, key string, plans ...string) int64 {
	t.Helper()
	var n int64
	for range 1000 {
		a, err := l.Allow(context.Background(), key, plans...)
		require.NoError(t, err)
		if !a.Allowed {
			break
		}
		n++
	}
	return n
}

// TestRefundAcrossAProportionalChainIsTheLeast: a reservation on plans
// "p" and "q", of 100 each, of which "p" goes proportional to 50 and "q"
// stays: one refund for both, scaled for "p", so that "p" gets back what
// its tokens became (30 of 30) and "q" less than it lent (35 of 60).
func TestRefundAcrossAProportionalChainIsTheLeast(t *testing.T) {
	q := Plan{Name: "q", Capacity: 100, Rate: 1.0 / 3600}
	eachStore(t, []Plan{hourly(1, 100, 0), q}, func(t *testing.T, l clockedLimiter) {
		ctx := context.Background()
		_, err := l.AllowN(ctx, "k", 40, "p", "q")
		require.NoError(t, err)
		r, err := l.Reserve(ctx, "k", 50, "p", "q")
		require.NoError(t, err)
		require.Equal(t, int64(10), r.Result().Remaining)
		require.NoError(t, l.SetPlans([]Plan{hourly(2, 50, InheritProportional), q}))
		st, err := r.Cancel(ctx)
		require.NoError(t, err)
		assert.Equal(t, int64(25), st.Refunded)
		assert.Equal(t, int64(30), admittedNow(t, l.Limiter, "k", "p"), "p: 60 × 50/100")
		assert.Equal(t, int64(35), admittedNow(t, l.Limiter, "k", "q"), "q: 10 and the refund of p")
	}, WithDenialCache(0))
}

// TestRefundAcrossAProportionalStepAndBack: version 2 goes proportional
// to 50, and a decision takes 1 under it (60 → 30 → 29; the reservation's
// 10 → 5 → 4); version 3 goes back to 100 as-is, which carries the tokens
// 1:1. The refund is scaled by the step it crossed, though the plans at
// the Reserve and at the Cancel have the same capacity: 4 + 25 = 29, not
// 4 + 50 = 54.
func TestRefundAcrossAProportionalStepAndBack(t *testing.T) {
	eachStore(t, []Plan{hourly(1, 100, 0)}, func(t *testing.T, l clockedLimiter) {
		ctx := context.Background()
		_, err := l.AllowN(ctx, "k", 40)
		require.NoError(t, err)
		r, err := l.Reserve(ctx, "k", 50)
		require.NoError(t, err)
		require.NoError(t, l.SetPlans([]Plan{hourly(2, 50, InheritProportional)}))
		a, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(4), a.Remaining, "10 × 50/100 − 1")
		require.NoError(t, l.SetPlans([]Plan{hourly(3, 100, 0)}))
		st, err := r.Cancel(ctx)
		require.NoError(t, err)
		after := admittedNow(t, l.Limiter, "k")
		t.Logf("refunded %d, %d admitted after", st.Refunded, after)
		assert.LessOrEqual(t, after, int64(29), "60 × 50/100 − 1 without the reservation")
		assert.Equal(t, int64(25), st.Refunded)
	}, WithDenialCache(0))
}

// TestLeaseGivenBackAcrossAProportionalVersion: plan "hot", version 1,
// capacity 100, admits 40, then a lease of 10 serves 1 (the bucket holds
// 50; without the lease it would hold 59). Version 2 goes proportional to
// 50: the lease's rest, 9, is given back under it, scaled as the bucket
// was, so the key admits 29 (59 × 50/100, rounded down), not 25 + 9 = 34.
func TestLeaseGivenBackAcrossAProportionalVersion(t *testing.T) {
	ctx := context.Background()
	v1 := Plan{Name: "hot", Capacity: 100, Rate: 1.0 / 3600, Lease: 10, Version: 1}
	v2 := v1
	v2.Capacity, v2.Version, v2.Inherit = 50, 2, InheritProportional
	rs, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{v1}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	_, err = l.AllowN(ctx, "k", 40)
	require.NoError(t, err)
	a, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, SourceStore, a.Source, "a lease of 10 taken")
	require.Equal(t, int64(50), remaining(t, rs, "k"))
	require.NoError(t, l.SetPlans([]Plan{v2}))
	admitted := countAdmitted(t, l, "k", 200)
	require.NoError(t, l.Close()) // gives back the lease in hand
	left := remaining(t, rs, "k")
	t.Logf("%d admitted under version 2, %d left", admitted, left)
	assert.LessOrEqual(t, admitted+left, int64(29), "59 × 50/100 without the lease")
	assert.GreaterOrEqual(t, admitted+left, int64(29-1), "less at most the rounding of the refund")
}

// TestRefundAcrossVersionsTheKeyMissedNeverMints: versions come and go
// while the key, after its Reserve (60 left, 10 with the reservation),
// decides under some of them only (take: 1 token under that table), so
// its bucket scales by the capacities it met, not by those of the
// tables. Version 2, proportional to 200, never meets the bucket; the
// refund after it is at most what the bucket would hold without the
// reservation.
func TestRefundAcrossVersionsTheKeyMissedNeverMints(t *testing.T) {
	for _, tt := range []struct {
		name    string
		tables  []Plan
		take    []bool
		without int64
	}{
		{"then as-is", []Plan{hourly(2, 200, InheritProportional), hourly(3, 200, 0)}, []bool{false, false}, 60},
		// 60, then 59 under version 3 (its last versioned capacity 100),
		// then 59 × 50/100 under version 4.
		{"then as-is, then proportional", []Plan{hourly(2, 200, InheritProportional), hourly(3, 100, 0), hourly(4, 50, InheritProportional)}, []bool{false, true, false}, 29},
	} {
		t.Run(tt.name, func(t *testing.T) {
			eachStore(t, []Plan{hourly(1, 100, 0)}, func(t *testing.T, l clockedLimiter) {
				ctx := context.Background()
				_, err := l.AllowN(ctx, "k", 40)
				require.NoError(t, err)
				r, err := l.Reserve(ctx, "k", 50)
				require.NoError(t, err)
				for i, p := range tt.tables {
					require.NoError(t, l.SetPlans([]Plan{p}))
					if tt.take[i] {
						a, err := l.Allow(ctx, "k")
						require.NoError(t, err)
						require.True(t, a.Allowed)
					}
				}
				st, err := r.Cancel(ctx)
				require.NoError(t, err)
				after := admittedNow(t, l.Limiter, "k")
				t.Logf("refunded %d, %d admitted after, %d without the reservation", st.Refunded, after, tt.without)
				assert.LessOrEqual(t, after, tt.without)
			}, WithDenialCache(0))
		})
	}
}
