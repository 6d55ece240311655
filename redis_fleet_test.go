package tollgate

import (
	"context"
	_ "embed"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// luaFleetV1 is scripts/fleet.lua as the releases before instances kept
// their own TTL ran it: it drops every member older than the caller's
// TTL. A fleet being upgraded runs both on one set.
//
//go:embed testdata/fleet_v1.lua
var luaFleetV1 string

// fleetScriptV1 runs luaFleetV1.
var fleetScriptV1 = redisscript.New(luaFleetV1)

// fleetBench is a miniredis whose clock the test moves, and a
// RedisStore on it whose heartbeats the test calls by hand.
type fleetBench struct {
	t     *testing.T
	mr    *miniredis.Miniredis
	c     *redis.Client
	store *RedisStore
	now   time.Time
}

func newFleetBench(t *testing.T) *fleetBench {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	b := &fleetBench{t: t, mr: mr, c: c, store: NewRedisStore(c), now: time.Unix(1_700_000_000, 0)}
	mr.SetTime(b.now)
	return b
}

// advance moves Redis's clock and its keys' TTLs on by d.
func (b *fleetBench) advance(d time.Duration) {
	b.now = b.now.Add(d)
	b.mr.SetTime(b.now)
	b.mr.FastForward(d)
}

// beat records a heartbeat of instance id, alive for ttl, and returns the
// instances it counted; v1 runs the script of the releases before.
func (b *fleetBench) beat(id string, ttl time.Duration, v1 bool) int64 {
	b.t.Helper()
	ctx := context.Background()
	if !v1 {
		n, err := b.store.heartbeat(ctx, id, ttl)
		require.NoError(b.t, err)
		return n
	}
	reply, err := fleetScriptV1.Run(ctx, b.c, []string{b.store.fleetKey()}, id, ttl.Microseconds())
	require.NoError(b.t, err)
	return reply.(int64)
}

// An instance that stops is dropped once its own TTL has passed, whatever
// the TTL of the instance counting: an instance alive for 15 s after its
// last heartbeat is counted for 15 s by one that beats every second, and
// one alive for 3 s is dropped after 3 s.
func TestFleetPrunesAnInstanceAfterItsOwnTTL(t *testing.T) {
	b := newFleetBench(t)
	short, long := 3*time.Second, 15*time.Second
	b.beat("a", short, false)
	b.beat("b", short, false)
	b.beat("long", long, false) // its last heartbeat
	for s := 1; s <= 16; s++ {
		b.advance(time.Second)
		b.beat("b", short, false)
		want := map[bool]int64{true: 3, false: 2}[s <= 15]
		assert.Equal(t, want, b.beat("a", short, false), "%d s after the 15 s instance stopped", s)
	}
	for s := 1; s <= 4; s++ { // b stopped at its last heartbeat
		b.advance(time.Second)
		want := map[bool]int64{true: 2, false: 1}[s <= 3]
		assert.Equal(t, want, b.beat("a", short, false), "%d s after the 3 s instance stopped", s)
	}
}

// The set lives as long as its longest-lived member: a heartbeat of an
// instance alive for 3 s does not make the set expire before one alive
// for 30 s that beat earlier. An instance alive for 30 s reads only the
// members older than 30 s: it counts one alive for 3 s that stopped
// until 30 s have passed, the lag every instance's own TTL has.
func TestFleetSetOutlivesItsLongestLivedMember(t *testing.T) {
	b := newFleetBench(t)
	long := 30 * time.Second
	b.beat("l1", long, false)
	b.advance(time.Second)
	b.beat("l2", long, false)
	b.advance(time.Second)
	b.beat("short", 3*time.Second, false) // its last heartbeat
	assert.Greater(t, b.mr.TTL(b.store.fleetKey()), 28*time.Second)
	b.advance(8 * time.Second)
	assert.Equal(t, int64(3), b.beat("l1", long, false), "l2 beat 9 s ago and is alive for 30 s")
	// The one alive for 3 s stopped 8 s ago: an instance alive for 30 s
	// drops it once its own 30 s have passed too.
	b.advance(20 * time.Second)
	b.beat("l2", long, false)
	b.advance(3 * time.Second)
	assert.Equal(t, int64(2), b.beat("l1", long, false), "33 s on")
}

// fleetSchedule beats, for 30 s, one instance every second (TTL 3 s) and
// three every 5 s (TTL 15 s, a second apart), all started at once, those
// whose bit of v1 is set running the script of the releases before, and
// returns each heartbeat's count in order.
func fleetSchedule(t *testing.T, v1 int) []int64 {
	b := newFleetBench(t)
	ttls := []time.Duration{3 * time.Second, 15 * time.Second, 15 * time.Second, 15 * time.Second}
	for i, ttl := range ttls { // all start at once
		b.beat(strconv.Itoa(i), ttl, v1&(1<<i) != 0)
	}
	var counts []int64
	for s := 1; s <= 30; s++ {
		b.advance(time.Second)
		for i, ttl := range ttls {
			if i == 0 || s%5 == i {
				counts = append(counts, b.beat(strconv.Itoa(i), ttl, v1&(1<<i) != 0))
			}
		}
	}
	return counts
}

// A fleet with instances of different intervals counts every instance
// alive at every heartbeat. While it is upgraded, instances of the
// releases before run their script on the same set; whichever instances
// run the new one, none counts fewer than in the fleet before the
// upgrade, and none counts more than the instances alive.
func TestFleetOfMixedIntervalsAcrossAnUpgrade(t *testing.T) {
	before := fleetSchedule(t, 0b1111)
	for v1 := range 0b1111 {
		got := fleetSchedule(t, v1)
		for i := range got {
			if !assert.GreaterOrEqual(t, got[i], before[i], "v1 instances %04b: heartbeat %d", v1, i) ||
				!assert.LessOrEqual(t, got[i], int64(4), "v1 instances %04b: heartbeat %d", v1, i) {
				break
			}
		}
		if v1 == 0 {
			assert.Equal(t, strings.Repeat("4", len(got)), fmtCounts(got), "every heartbeat of the upgraded fleet")
		}
	}
}

// fmtCounts writes counts of one digit each as one string.
func fmtCounts(counts []int64) string {
	var sb strings.Builder
	for _, n := range counts {
		sb.WriteString(strconv.FormatInt(n, 10))
	}
	return sb.String()
}
