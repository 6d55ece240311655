package tollgate

import (
	"context"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestChainOfTooManyPlans: a decision chains at most maxChain plans,
// through a store or a Limiter, the last of them shadowed or not; one
// more is ErrInvalidPlan, since the scripts could not report it.
func TestChainOfTooManyPlans(t *testing.T) {
	ctx := context.Background()
	plans := make([]Plan, maxChain+1)
	for i := range plans {
		plans[i] = Plan{Name: "p" + strconv.Itoa(i), Capacity: 1, Rate: 1}
	}
	_, err := NewMemoryStore().Take(ctx, "k", 1, plans)
	assert.ErrorIs(t, err, ErrInvalidPlan)
	l, err := New(NewMemoryStore(), plans)
	require.NoError(t, err, "a table may hold any number of plans")
	_, err = l.AllowPlans(ctx, "k", 1, plans...)
	assert.ErrorIs(t, err, ErrInvalidPlan)

	plans = plans[:maxChain]
	plans[maxChain-1].Shadow = true
	_, err = NewMemoryStore().Take(ctx, "k", 1, plans)
	assert.NoError(t, err)
	r, err := l.AllowPlans(ctx, "k", 1, plans...)
	require.NoError(t, err)
	assert.True(t, r.Allowed)
}
