package tollgate

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStoresRefuseABadPlanName calls the stores directly, as a program of
// its own may: a plan name the Limiter refuses would make a Redis key of
// a hold's (~ID), of no plan at all, or outside the key scheme.
func TestStoresRefuseABadPlanName(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	for name, s := range map[string]Store{"memory": NewMemoryStore(), "redis": rs} {
		for _, bad := range []string{"", "~1", "a:b", "}x", "a b"} {
			plans := []Plan{{Name: bad, Capacity: 10, Rate: 1}}
			_, err := s.Take(ctx, "k", 1, plans)
			assert.ErrorIs(t, err, ErrInvalidPlan, "%s: Take with plan %q", name, bad)
			assert.ErrorIs(t, s.Reset(ctx, "k", plans), ErrInvalidPlan, "%s: Reset with plan %q", name, bad)
		}
	}
	assert.Empty(t, mr.Keys(), "no key was written")
	_, err := rs.Take(ctx, "k", 1, []Plan{{Name: "fine", Capacity: 10, Rate: 1}})
	require.NoError(t, err)
}
