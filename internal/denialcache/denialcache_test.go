package denialcache

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const hour = int64(time.Hour)

func TestGetMatchesTheSameRequestUntilItEnds(t *testing.T) {
	c := New[string](10, time.Now())
	now := c.Now()
	c.Put("k", "p", 2, "denied", now, now+hour)
	var v string
	asked, until, ok := c.Get("k", "p", 2, now, &v)
	assert.True(t, ok)
	assert.Equal(t, "denied", v)
	assert.Equal(t, now, asked)
	assert.Equal(t, now+hour, until)
	_, _, ok = c.Get("k", "p", 1, now, new(string))
	assert.False(t, ok, "a cheaper request may pass")
	_, _, ok = c.Get("k", "p,q", 2, now, new(string))
	assert.False(t, ok, "other plans")
	_, _, ok = c.Get("k", "p", 2, now+hour, new(string))
	assert.False(t, ok, "ended")
}

func TestIsBounded(t *testing.T) {
	c := New[int](100, time.Now())
	for i := 0; i < 10_000; i++ {
		c.Put("key-"+strconv.Itoa(i), "p", 1, i, c.Now(), c.Now()+hour)
	}
	assert.LessOrEqual(t, c.Len(), 100)
}

func TestRefusesDenialsOlderThanAForget(t *testing.T) {
	c := New[int](10, time.Now())
	asked := c.Now()
	c.Forget("k") // a Reset while the denied request was in flight
	c.Put("k", "p", 1, 0, asked, asked+hour)
	_, _, ok := c.Get("k", "p", 1, c.Now(), new(int))
	assert.False(t, ok, "a denial asked before the Reset may be stale")
	now := c.Now()
	c.Put("k", "p", 1, 0, now, now+hour)
	_, _, ok = c.Get("k", "p", 1, c.Now(), new(int))
	assert.True(t, ok)
}

func TestBoundsEachKey(t *testing.T) {
	c := New[int](10, time.Now())
	for cost := int64(1); cost <= 1000; cost++ {
		now := c.Now()
		c.Put("k", "p", cost, 0, now, now+hour)
	}
	assert.LessOrEqual(t, len(c.keys["k"]), MaxPerKey)
	_, _, ok := c.Get("k", "p", 1000, c.Now(), new(int))
	assert.True(t, ok, "the newest denial is kept")
}

func TestKeepsADenialOfTheFirstInstant(t *testing.T) {
	c := New[int](10, time.Now())
	c.Put("k", "p", 1, 7, 0, hour)
	var v int
	_, _, ok := c.Get("k", "p", 1, 0, &v)
	assert.True(t, ok)
	assert.Equal(t, 7, v)
}

func TestARequestUnderOtherParametersForgetsTheKeysDenials(t *testing.T) {
	c := New[int](10, time.Now())
	now := c.Now()
	c.Put("k", "api#2/1", 1, 0, now, now+hour)
	c.Put("k", "daily#100/1", 1, 0, now, now+hour)
	c.Put("k", "api#2/1,daily#100/1", 1, 0, now, now+hour)
	c.Put("other", "api#2/1", 1, 0, now, now+hour)

	_, _, ok := c.Get("k", "api#10/5", 1, now, new(int))
	assert.False(t, ok)
	_, _, ok = c.Get("k", "api#2/1", 1, now, new(int))
	assert.False(t, ok, "forgotten: the bucket may have filled under the other parameters")
	_, _, ok = c.Get("k", "api#2/1,daily#100/1", 1, now, new(int))
	assert.False(t, ok, "a chain that holds the plan is forgotten too")
	_, _, ok = c.Get("k", "daily#100/1", 1, now, new(int))
	assert.True(t, ok, "another plan's bucket is not the same")
	_, _, ok = c.Get("other", "api#2/1", 1, now, new(int))
	assert.True(t, ok, "another key's")

	c.Supersede("k", "daily#100/2")
	_, _, ok = c.Get("k", "daily#100/1", 1, now, new(int))
	assert.False(t, ok, "a read under other parameters forgets too")

	c.Put("k", "api#2/1", 1, 0, now+1, now+hour)
	c.Put("k", "api#2/2", 1, 0, now+1, now+hour)
	_, _, ok = c.Get("k", "api#2/1", 1, now, new(int))
	assert.False(t, ok, "a denial under other parameters forgets too")
	assert.LessOrEqual(t, len(c.keys["k"]), MaxPerKey)
}

func TestForgetAll(t *testing.T) {
	c := New[int](10, time.Now())
	asked := c.Now()
	c.Put("k", "p", 1, 0, asked, asked+hour)
	c.ForgetAll()
	assert.Zero(t, c.Len())
	c.Put("k", "p", 1, 0, asked, asked+hour)
	_, _, ok := c.Get("k", "p", 1, c.Now(), new(int))
	assert.False(t, ok, "a denial asked before the change of plans may be stale")
}

func TestGetAllocatesNothing(t *testing.T) {
	c := New[[4]int64](10, time.Now())
	now := c.Now()
	c.Put("k", "api#2/1,daily#100/1", 1, [4]int64{}, now, now+hour)
	var v [4]int64
	assert.Zero(t, testing.AllocsPerRun(100, func() { c.Get("k", "api#2/1,daily#100/1", 1, now, &v) }), "a hit")
	assert.Zero(t, testing.AllocsPerRun(100, func() { c.Get("k", "api#2/1", 2, now, &v) }), "a miss")
	assert.Zero(t, testing.AllocsPerRun(100, func() { c.Get("k", "api#2/2", 1, now, &v) }), "a conflict")
}

// A denial in flight while the key was asked under other parameters of a
// plan, and then under the denial's own again, is stale when it lands:
// the bucket may have filled under the others, and no entry was there for
// the request under them to forget.
func TestRefusesADenialAskedBeforeAConflictingRequest(t *testing.T) {
	c := New[int](10, time.Now())
	asked := c.Now()
	_, _, ok := c.Get("k", "api#2/1", 1, asked, new(int))
	require.False(t, ok)
	_, _, ok = c.Get("k", "api#10/5", 1, c.Now(), new(int)) // the gold tier
	require.False(t, ok)
	_, _, ok = c.Get("k", "api#2/1", 1, c.Now(), new(int)) // back to free
	require.False(t, ok)
	c.Put("k", "api#2/1", 1, 0, asked, asked+hour)
	_, _, ok = c.Get("k", "api#2/1", 1, c.Now(), new(int))
	assert.False(t, ok, "refused: asked before the gold tier's request")

	now := c.Now()
	_, _, ok = c.Get("k", "api#2/1", 1, now, new(int))
	require.False(t, ok)
	c.Supersede("k", "api#10/5,daily#100/1") // a read of a chain under gold
	c.Put("k", "api#2/1", 1, 0, now, now+hour)
	_, _, ok = c.Get("k", "api#2/1", 1, c.Now(), new(int))
	assert.False(t, ok, "refused: asked before a read under gold")

	// The gold request read the clock first but reached the cache last:
	// its store call may come after the free tier's.
	gold, free := c.Now(), c.Now()+1
	c.Get("k", "api#2/1", 1, free, new(int))
	c.Get("k", "api#10/5", 1, gold, new(int))
	c.Put("k", "api#2/1", 1, 0, free, free+hour)
	_, _, ok = c.Get("k", "api#2/1", 1, c.Now(), new(int))
	assert.False(t, ok, "refused: the gold request reached the cache after it")
}

// Requests under the same parameters, or of other keys, or under plans
// of other names, leave a denial in flight alone.
func TestKeepsADenialInFlightBesideRequestsThatDoNotConflict(t *testing.T) {
	c := New[int](10, time.Now())
	asked := c.Now()
	c.Get("k", "api#2/1", 1, asked, new(int))
	c.Get("k", "api#2/1", 3, c.Now(), new(int))
	c.Get("k", "api#2/1,daily#100/1", 1, c.Now(), new(int))
	c.Put("k", "api#2/1", 1, 7, asked, asked+hour)
	var v int
	_, _, ok := c.Get("k", "api#2/1", 1, c.Now(), &v)
	assert.True(t, ok)
	assert.Equal(t, 7, v)
}
