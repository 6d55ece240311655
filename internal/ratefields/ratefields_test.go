package ratefields

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
)

// The field values themselves are tested through the adapters that write
// them (httplimit's TestFields, grpclimit's metadata tests); these tests
// hold what only this package can see.

func TestFieldsOfAChain(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "gold", Capacity: 20, Rate: 2},
		{Name: "daily", Capacity: 10_000, Rate: tollgate.Per(10_000, 24*time.Hour)},
	})
	require.NoError(t, err)
	res, err := lim.Allow(context.Background(), "k", "gold", "daily")
	require.NoError(t, err)

	assert.Equal(t, `"gold";q=20;w=10, "daily";q=10000;w=86400`, string(AppendPolicy(nil, &res, lim, false)))
	assert.Equal(t, `"gold";r=19;t=1, "daily";r=9999;t=9`, string(AppendRateLimit(nil, &res, lim, false)))
	// A Limiter's Result tells the Rate it applied: no Planner is needed.
	assert.Equal(t, `"gold";q=20;w=10, "daily";q=10000;w=86400`, string(AppendPolicy(nil, &res, nil, false)))
	// A Result that tells no Rate (another RateLimiter's), without a
	// Planner: the fields that need a plan's Rate are left out.
	foreign := tollgate.Result{Allowed: true, Plan: "gold", Limit: 20, Remaining: 19}
	assert.Equal(t, `"gold";q=20`, string(AppendPolicy(nil, &foreign, nil, false)))
	assert.Equal(t, `"gold";r=19`, string(AppendRateLimit(nil, &foreign, nil, false)))
	assert.Equal(t, "20", string(AppendLimit(nil, &res)))
	assert.Equal(t, "19", string(AppendRemaining(nil, &res)))
	assert.Equal(t, "1", string(AppendReset(nil, &res)))
}

func TestFieldsOfAWindow(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "api", Capacity: 100, Window: time.Minute},
		{Name: "sec", Capacity: 5, Rate: 5},
	})
	require.NoError(t, err)
	fresh := tollgate.Result{Plan: "api", Limit: 100, Remaining: 100}
	assert.Equal(t, `"api";q=100;w=60`, string(AppendPolicy(nil, &fresh, lim, false)))
	assert.Equal(t, `"api";r=100;t=60`, string(AppendRateLimit(nil, &fresh, lim, false)), "an empty window: its Window")
	res, err := lim.Allow(context.Background(), "k", "api", "sec")
	require.NoError(t, err)
	prs := res.PlanResults()
	require.Greater(t, prs[0].ResetAfter, 57*time.Second, "the count leaves when its sub-window does")
	assert.Equal(t, `"api";q=100;w=60, "sec";q=5;w=1`, string(AppendPolicy(nil, &res, lim, false)))
	assert.Equal(t, fmt.Sprintf(`"api";r=99;t=%d, "sec";r=4;t=1`, CeilSeconds(prs[0].ResetAfter)), string(AppendRateLimit(nil, &res, lim, false)))

	// Refused, t is the wait until the request would pass, never more
	// than Retry-After, though the window empties later.
	denied := tollgate.Result{Plan: "api", Limit: 100, RetryAfter: 3500 * time.Millisecond, ResetAfter: 5 * time.Second}
	assert.Equal(t, `"api";r=0;t=4`, string(AppendRateLimit(nil, &denied, lim, false)))
	assert.Equal(t, "4", string(AppendRetryAfter(nil, &denied)))
}

func TestPlanNamesAreStrings(t *testing.T) {
	res := tollgate.Result{Plan: "a\"b\\c\x01é", Limit: 1}
	assert.Equal(t, `"a\"b\\c";q=1`, string(AppendPolicy(nil, &res, nil, false)))
}

func TestRetryAfterRoundsUpToAtLeastOne(t *testing.T) {
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{{0, "1"}, {time.Microsecond, "1"}, {300 * time.Millisecond, "1"}, {time.Second, "1"}, {1200 * time.Millisecond, "2"}, {-time.Second, "1"}} {
		res := tollgate.Result{RetryAfter: tt.d}
		assert.Equal(t, tt.want, string(AppendRetryAfter(nil, &res)), "RetryAfter %v", tt.d)
	}
}

func TestAppendsAllocateNothing(t *testing.T) {
	res := tollgate.Result{Plan: "gold", Limit: 20, Remaining: 3, ResetAfter: 8 * time.Second}
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "gold", Capacity: 20, Rate: 2}})
	require.NoError(t, err)
	buf := make([]byte, 0, 256)
	allocs := testing.AllocsPerRun(100, func() {
		b := AppendPolicy(buf[:0], &res, lim, false)
		b = AppendRateLimit(b, &res, lim, false)
		_ = AppendRetryAfter(b, &res)
	})
	assert.Zero(t, allocs)
}

// The fields describe the plan a resolver applied for the key, not the
// table's plan of that name, and leave shadowed plans out unless asked.
func TestFieldsDescribeThePlanApplied(t *testing.T) {
	gold := tollgate.Plan{Name: "api", Capacity: 100, Rate: 10}
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "api", Capacity: 10, Rate: 1},
		{Name: "new", Capacity: 5, Rate: 1, Shadow: true},
	}, tollgate.WithPlanResolver(func(_ context.Context, key string, p tollgate.Plan) (tollgate.Plan, error) {
		if key == "gold-customer" && p.Name == "api" {
			return gold, nil
		}
		return p, nil
	}))
	require.NoError(t, err)
	res, err := lim.Allow(context.Background(), "gold-customer", "api", "new")
	require.NoError(t, err)
	assert.Equal(t, `"api";q=100;w=10`, string(AppendPolicy(nil, &res, lim, false)))
	assert.Equal(t, `"api";q=100;w=10, "new";q=5;w=5`, string(AppendPolicy(nil, &res, lim, true)))
	assert.Equal(t, `"api";r=99;t=1, "new";r=4;t=1`, string(AppendRateLimit(nil, &res, lim, true)))
}

// TestFieldsOfAConcurrencyPlan: a concurrency plan tells its capacity and
// free permits, and no window, which it does not have; it binds with no
// reset and no Retry-After (Concurrent).
func TestFieldsOfAConcurrencyPlan(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "inflight", Capacity: 2, Concurrency: true},
		{Name: "gold", Capacity: 20, Rate: 2},
	})
	require.NoError(t, err)
	defer lim.Close()
	ctx := context.Background()
	first, err := lim.Acquire(ctx, "k", 1, "inflight", "gold")
	require.NoError(t, err)
	res := first.Result()
	assert.Equal(t, `"inflight";q=2, "gold";q=20;w=10`, string(AppendPolicy(nil, &res, lim, false)))
	assert.Equal(t, `"inflight";r=1, "gold";r=19;t=1`, string(AppendRateLimit(nil, &res, lim, false)))
	assert.True(t, Concurrent(&res, lim), "one permit free of 2 binds over 19 tokens of 20")
	assert.False(t, Concurrent(&res, nil), "no Planner tells")

	_, err = lim.Acquire(ctx, "k", 1, "inflight", "gold")
	require.NoError(t, err)
	full, err := lim.Acquire(ctx, "k", 1, "inflight")
	require.NoError(t, err)
	res = full.Result()
	require.False(t, res.Allowed)
	assert.Equal(t, `"inflight";q=2`, string(AppendPolicy(nil, &res, lim, false)))
	assert.Equal(t, `"inflight";r=0`, string(AppendRateLimit(nil, &res, lim, false)))
	assert.True(t, Concurrent(&res, lim))

	bucket, err := lim.Allow(ctx, "k", "gold")
	require.NoError(t, err)
	assert.False(t, Concurrent(&bucket, lim), "a bucket plan binds")
}
