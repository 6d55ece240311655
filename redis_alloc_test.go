package tollgate

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRedisDecisionAllocatesOnlyItsKey pins the client's allocations of a
// Redis decision: a hook answers every command with a canned reply, so
// what is counted is go-redis building its command (measured alone, on
// the same keys and ARGV) and tollgate's own work, which is one
// allocation, the Redis key's string. Keys and ARGV are built in a pooled
// scriptCall, and the plan's numbers come boxed from the store's cache.
func TestRedisDecisionAllocatesOnlyItsKey(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop calls at random")
	}
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	c.AddHook(cannedReply{[]any{int64(1), int64(1 << 50), int64(1 << 40), int64(1 << 50)}})
	s := NewRedisStore(c)
	l, err := New(s, benchPlan)
	require.NoError(t, err)

	keys, args := s.keys("user-42", benchPlan), s.args(1, benchPlan)
	goRedis := testing.AllocsPerRun(1000, func() { _, _ = s.scripts.take.Run(ctx, c, keys, args...) })

	_, err = l.Allow(ctx, "user-42")
	require.NoError(t, err)
	decision := testing.AllocsPerRun(1000, func() { _, _ = l.Allow(ctx, "user-42") })
	assert.Equal(t, goRedis+1, decision, "go-redis's %v and one for the key", goRedis)
}

// TestScriptCallAllocatesOnlyKeys pins what building a decision's script
// call costs, on both the narrow ARGV layout and the wide one: a string
// per Redis key, whatever the plans, once each plan has been seen.
func TestScriptCallAllocatesOnlyKeys(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop calls at random")
	}
	s := NewRedisStore(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}))
	t.Cleanup(func() { _ = s.client.Close() })
	for _, plans := range [][]Plan{
		benchPlan,
		{gold, {Name: "shadowed", Capacity: 1000, Rate: 0.25, Shadow: true}},
		{gold, benchWindow[0], {Name: "versioned", Capacity: 300, Rate: 12.5, Version: 70}},
	} {
		build := func() {
			c := newScriptCall()
			c.Keys = s.appendKeys(c.keys[:0], "user-42", plans)
			c.Args = s.appendArgs(c.args[:0], 1000, plans)
			c.recycle()
		}
		build()
		// 1000, the cost, is boxed too: a cost of 256 or more costs one.
		assert.Equal(t, float64(len(plans)+1), testing.AllocsPerRun(1000, build), "%d plans", len(plans))
	}
}

// TestPlanArgCache checks that the boxed numbers the store caches are those
// of each plan, for every layout, and that the cache stops growing at
// maxCachedPlans while further plans still get their own numbers.
func TestPlanArgCache(t *testing.T) {
	plans := []Plan{
		gold,
		{Name: "shadow", Capacity: 1000, Rate: 0.001, Shadow: true},
		{Name: "versioned", Capacity: 300, Rate: 12.5, Version: 70, Inherit: InheritProportional},
		{Name: "window", Capacity: 500, Window: 90 * 1e9},
		{Name: "suppressed", Capacity: 500, Window: 1e9, Slots: 10, Suppress: 1.5},
	}
	var c planArgCache
	get := func(p *Plan) []any { return c.appendTo([]any{"before"}, p, 4)[1:] }
	for range 2 { // a miss, then a hit
		for i := range plans {
			want := newPlanArgs(&plans[i])
			assert.Equal(t, want[:], get(&plans[i]), "plan %s", plans[i].Name)
		}
	}
	for i := range maxCachedPlans + 10 {
		p := Plan{Name: fmt.Sprint("p", i), Capacity: int64(1 + i), Rate: 1}
		want := newPlanArgs(&p)
		assert.Equal(t, want[:], get(&p), "plan %s", p.Name)
	}
	assert.Len(t, *c.m.Load(), maxCachedPlans)
	want := newPlanArgs(&plans[0])
	assert.Equal(t, want[:], get(&plans[0]), "cached before the bound")
	assert.Equal(t, want[:2], c.appendTo(nil, &plans[0], 2), "the narrow layout")
}
