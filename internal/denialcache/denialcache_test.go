package denialcache

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
