package breaker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// clock is a test's monotonic clock for a Shared breaker, in ns.
type clock struct{ ns atomic.Int64 }

func (c *clock) now() int64 { return c.ns.Load() }

// mini is a miniredis whose TIME, TTLs and the breakers' local clock move
// together.
type mini struct {
	mr    *miniredis.Miniredis
	c     *redis.Client
	clock *clock
	at    time.Duration
}

func newMini(t *testing.T) *mini {
	t.Helper()
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(epochUs))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = c.Close() })
	return &mini{mr: mr, c: c, clock: &clock{}}
}

// advance moves Redis's clock, its TTLs and the local clock by d.
func (m *mini) advance(d time.Duration) {
	m.at += d
	m.mr.SetTime(time.UnixMicro(epochUs).Add(m.at))
	m.mr.FastForward(d)
	m.clock.ns.Add(int64(d))
}

// shared returns a Shared breaker on m's Redis and clock, logging nowhere.
func (m *mini) shared(t *testing.T, s SharedSettings, opts ...SharedOption) *Shared {
	t.Helper()
	b, err := NewShared(m.c, s, append([]SharedOption{WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	b.now = m.clock.now
	return b
}

var ctx = context.Background()

// fastSettings trip at half of 4 calls and stay open 1s.
var fastSettings = SharedSettings{Window: 10 * time.Second, MinCalls: 4, FailureRate: 0.5,
	OpenFor: time.Second, ProbeTimeout: 100 * time.Millisecond}

// call acquires and reports one call.
func call(t *testing.T, b *Shared, key string, o Outcome) error {
	t.Helper()
	tk, err := b.Acquire(ctx, key)
	if err != nil {
		return err
	}
	return tk.Done(ctx, o)
}

// trip fails calls on key until the breaker opens.
func trip(t *testing.T, b *Shared, key string) {
	t.Helper()
	for i := 0; ; i++ {
		require.Less(t, i, 1000, "the breaker never tripped")
		if err := call(t, b, key, Failure); errors.Is(err, ErrOpen) {
			return
		}
	}
}

func TestSharedSettingsValidation(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	bad := map[string]SharedSettings{
		"negative window":        {Window: -1},
		"tiny window":            {Window: time.Microsecond},
		"rate above 1":           {FailureRate: 1.5},
		"negative rate":          {FailureRate: -0.1},
		"NaN rate":               {FailureRate: nanRate()},
		"slow rate above 1":      {SlowRate: 2},
		"negative min calls":     {MinCalls: -1},
		"negative consecutive":   {Consecutive: -3},
		"negative open":          {OpenFor: -time.Second},
		"max open below open":    {OpenFor: time.Minute, MaxOpenFor: time.Second},
		"negative probes":        {Probes: -1},
		"too many probes":        {Probes: 1001},
		"negative probe timeout": {ProbeTimeout: -1},
		"negative cache":         {CacheClosedFor: -1},
		"open over a year":       {OpenFor: 400 * 24 * time.Hour},
	}
	for name, s := range bad {
		t.Run(name, func(t *testing.T) {
			_, err := NewShared(c, s)
			require.ErrorIs(t, err, ErrInvalidSettings)
		})
	}
	_, err := NewShared(nil, SharedSettings{})
	require.ErrorIs(t, err, ErrInvalidSettings, "nil client")
	_, err = NewShared(c, SharedSettings{}, WithPrefix("a{b"))
	require.ErrorIs(t, err, ErrInvalidSettings, "braced prefix")
	_, err = NewShared(c, SharedSettings{}, WithFailurePolicy(FailurePolicy(9)))
	require.ErrorIs(t, err, ErrInvalidSettings, "unknown policy")
	_, err = NewShared(c, SharedSettings{}, WithStoreBreaker(Settings{Cooldown: -1}))
	require.ErrorIs(t, err, ErrInvalidSettings, "bad store breaker")
	_, err = NewShared(c, SharedSettings{}, WithLogger(&slog.Logger{}))
	require.ErrorIs(t, err, ErrInvalidSettings, "a Logger without a Handler")

	b, err := NewShared(c, SharedSettings{})
	require.NoError(t, err)
	assert.Equal(t, SharedSettings{Window: 10 * time.Second, MinCalls: 20, FailureRate: 0.5, SlowRate: 1,
		OpenFor: 30 * time.Second, MaxOpenFor: 30 * time.Second, Probes: 1, ProbeTimeout: 10 * time.Second},
		b.Settings(), "the documented defaults")
}

func nanRate() float64 {
	zero := 0.0
	return zero / zero
}

func TestSharedInvalidKey(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings)
	for _, key := range []string{"", strings.Repeat("k", MaxKeyLen+1)} {
		_, err := b.Acquire(ctx, key)
		require.ErrorIs(t, err, ErrInvalidKey)
		require.ErrorIs(t, b.RecordFailure(ctx, key), ErrInvalidKey)
		_, err = b.State(ctx, key)
		require.ErrorIs(t, err, ErrInvalidKey)
		require.ErrorIs(t, b.Reset(ctx, key), ErrInvalidKey)
		_, err = b.Allow(ctx, key)
		require.ErrorIs(t, err, ErrInvalidKey)
		assert.NotContains(t, err.Error(), "kkkk", "keys never appear in errors")
	}
	_, err := b.Acquire(ctx, strings.Repeat("k", MaxKeyLen))
	require.NoError(t, err)
	assert.Equal(t, uint64(0), b.Stats().StoreErrors)
}

// TestSharedTripRule checks the trip rules exactly: outcomes in order (S
// success, F failure, s slow success), and whether the last one trips.
func TestSharedTripRule(t *testing.T) {
	cases := []struct {
		name     string
		set      SharedSettings
		outcomes string
		tripped  bool
	}{
		{"below min calls", SharedSettings{MinCalls: 4, FailureRate: 0.5}, "FFF", false},
		{"at min calls, at rate", SharedSettings{MinCalls: 4, FailureRate: 0.5}, "SSFF", true},
		{"at min calls, below rate", SharedSettings{MinCalls: 4, FailureRate: 0.5}, "SSSF", false},
		{"rate is inclusive", SharedSettings{MinCalls: 10, FailureRate: 0.3}, "SSSSSSSFFF", true},
		{"just below rate", SharedSettings{MinCalls: 10, FailureRate: 0.3}, "SSSSSSSSFF", false},
		{"rate 1 needs every call", SharedSettings{MinCalls: 3, FailureRate: 1}, "SFF", false},
		{"rate 1", SharedSettings{MinCalls: 3, FailureRate: 1}, "FFF", true},
		{"success never trips", SharedSettings{MinCalls: 1, FailureRate: 0.000001}, "SSSS", false},
		{"consecutive", SharedSettings{MinCalls: 100, Consecutive: 3}, "FFSFFF", true},
		{"consecutive broken", SharedSettings{MinCalls: 100, Consecutive: 3}, "FFSFF", false},
		{"slow rate", SharedSettings{MinCalls: 4, SlowCall: time.Millisecond, SlowRate: 0.5}, "SSss", true},
		{"slow rate below", SharedSettings{MinCalls: 4, SlowCall: time.Millisecond, SlowRate: 0.5}, "SSSs", false},
		{"slow off", SharedSettings{MinCalls: 4}, "ssss", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := newMini(t)
			b := m.shared(t, c.set)
			for i, o := range c.outcomes {
				tk, err := b.Acquire(ctx, "dest")
				require.NoError(t, err, "call %d", i)
				if o == 's' {
					m.advance(2 * time.Millisecond)
				}
				out := Success
				if o == 'F' {
					out = Failure
				}
				require.NoError(t, tk.Done(ctx, out), "call %d", i)
				st, err := b.State(ctx, "dest")
				require.NoError(t, err)
				if i < len(c.outcomes)-1 {
					require.Equal(t, Closed, st, "call %d: tripped early", i)
				} else if c.tripped {
					assert.Equal(t, Open, st)
				} else {
					assert.Equal(t, Closed, st)
				}
			}
		})
	}
}

func TestSharedWindowForgetsOldCalls(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, SharedSettings{Window: time.Second, MinCalls: 4, FailureRate: 0.5})
	require.NoError(t, call(t, b, "k", Failure))
	require.NoError(t, call(t, b, "k", Failure))
	require.NoError(t, call(t, b, "k", Failure))
	m.advance(1100 * time.Millisecond)
	for range 3 {
		require.NoError(t, call(t, b, "k", Success))
	}
	require.NoError(t, call(t, b, "k", Failure), "1 of 4 in the window")
	snap, err := b.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Snapshot{State: Closed, Calls: 4, Failures: 1}, snap)
}

// TestSharedFencing: a call granted before the breaker opened neither
// counts against it nor closes it.
func TestSharedFencing(t *testing.T) {
	m := newMini(t)
	a, b := m.shared(t, fastSettings), m.shared(t, fastSettings)
	early, err := a.Acquire(ctx, "k")
	require.NoError(t, err)
	earlyOK, err := a.Acquire(ctx, "k")
	require.NoError(t, err)
	trip(t, b, "k")
	before, err := b.Inspect(ctx, "k")
	require.NoError(t, err)

	require.ErrorIs(t, early.Done(ctx, Failure), ErrStale)
	m.advance(time.Second)
	probe, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, probe.Probe())
	require.ErrorIs(t, earlyOK.Done(ctx, Success), ErrStale, "a closed call must not close a half-open breaker")
	snap, err := b.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, HalfOpen, snap.State)
	assert.Equal(t, before.Generation+1, snap.Generation)

	require.NoError(t, probe.Done(ctx, Success))
	require.ErrorIs(t, probe.Done(ctx, Success), ErrTicketDone, "reported twice")
	require.ErrorIs(t, Ticket{}.Done(ctx, Success), ErrTicketDone, "never granted")
	snap, err = b.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Snapshot{State: Closed, Generation: before.Generation + 2, Trips: 1}, snap)
	assert.Equal(t, uint64(2), a.Stats().Stale)
}

// TestSharedDeadProber: a prober that never reports loses its lease after
// ProbeTimeout; another instance probes, and the old holder's late
// success is ignored.
func TestSharedDeadProber(t *testing.T) {
	m := newMini(t)
	dead, live := m.shared(t, fastSettings), m.shared(t, fastSettings)
	trip(t, live, "k")
	m.advance(time.Second)
	lost, err := dead.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, lost.Probe())

	tk, err := live.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen, "one probe fleet-wide")
	assert.Equal(t, 100*time.Millisecond, tk.RetryAfter)
	m.advance(99 * time.Millisecond)
	_, err = live.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen)
	m.advance(time.Millisecond)
	probe, err := live.Acquire(ctx, "k")
	require.NoError(t, err, "the lease expired")
	require.True(t, probe.Probe())

	require.ErrorIs(t, lost.Done(ctx, Success), ErrStale, "the dead prober's late success")
	st, err := live.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, HalfOpen, st)
	require.NoError(t, probe.Done(ctx, Success))
	st, err = live.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Closed, st)
}

func TestSharedIgnoredProbeFreesItsLease(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings)
	trip(t, b, "k")
	m.advance(time.Second)
	p1, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, p1.Done(ctx, Ignore))
	p2, err := b.Acquire(ctx, "k")
	require.NoError(t, err, "an ignored probe hands its lease on at once")
	assert.True(t, p2.Probe())
}

func TestSharedOpenTimeGrows(t *testing.T) {
	m := newMini(t)
	set := fastSettings
	set.MaxOpenFor = 3 * time.Second
	b := m.shared(t, set)
	trip(t, b, "k")
	for i, want := range []time.Duration{2 * time.Second, 3 * time.Second, 3 * time.Second} {
		m.advance(10 * time.Second)
		p, err := b.Acquire(ctx, "k")
		require.NoError(t, err)
		require.NoError(t, p.Done(ctx, Failure))
		snap, err := b.Inspect(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, want, snap.RetryAfter, "failed probe %d", i+1)
	}
	m.advance(10 * time.Second)
	p, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	require.NoError(t, p.Done(ctx, Success))
	trip(t, b, "k")
	snap, err := b.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, time.Second, snap.RetryAfter, "a closed breaker starts again at OpenFor")
	assert.Equal(t, int64(2), snap.Trips)
}

func TestSharedForeignValueIsReplaced(t *testing.T) {
	for name, plant := range map[string]func(mr *miniredis.Miniredis, key string){
		"string":         func(mr *miniredis.Miniredis, key string) { _ = mr.Set(key, "hello") },
		"list":           func(mr *miniredis.Miniredis, key string) { _, _ = mr.Push(key, "a") },
		"other schema":   func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "2", "s", "1") },
		"bad state":      func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "1", "s", "7", "g", "3") },
		"negative count": func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "1", "s", "0", "n3", "-4") },
		"fraction":       func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "1", "s", "1", "ou", "1.5") },
		"huge":           func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "1", "s", "1", "ou", "1e300") },
		"not a number":   func(mr *miniredis.Miniredis, key string) { mr.HSet(key, "v", "1", "s", "0", "g", "x") },
	} {
		t.Run(name, func(t *testing.T) {
			m := newMini(t)
			b := m.shared(t, fastSettings)
			plant(m.mr, b.Key("k"))
			snap, err := b.Inspect(ctx, "k")
			require.ErrorIs(t, err, ErrForeignValue)
			assert.Equal(t, Snapshot{State: Closed}, snap, "read as a fresh breaker, never misread")
			tk, err := b.Acquire(ctx, "k")
			require.NoError(t, err)
			require.NoError(t, tk.Done(ctx, Success))
			snap, err = b.Inspect(ctx, "k")
			require.NoError(t, err, "replaced")
			assert.Equal(t, Snapshot{State: Closed, Calls: 1}, snap)
			assert.Equal(t, uint64(1), b.Stats().Foreign)
		})
	}
}

func TestSharedAdmin(t *testing.T) {
	m := newMini(t)
	admin, user := m.shared(t, fastSettings), m.shared(t, fastSettings)
	require.NoError(t, admin.ForceOpen(ctx, "k"))
	_, err := user.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen)
	m.advance(time.Hour)
	_, err = user.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen, "held open however long")
	snap, err := admin.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.True(t, snap.Forced)
	assert.Equal(t, int64(0), snap.Trips, "forcing is not a trip")

	require.NoError(t, admin.ForceClosed(ctx, "k"))
	m.advance(time.Second) // the user's memory of a forced open lasts OpenFor
	require.NoError(t, call(t, user, "k", Success))

	trip(t, user, "k")
	require.NoError(t, admin.Reset(ctx, "k"))
	snap, err = admin.Inspect(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Closed, snap.State)
	assert.Equal(t, int64(0), snap.Trips)
	assert.Positive(t, snap.Generation, "the generation survives a reset")
}

// TestSharedSeedInterface drives seed 001's interface as written.
func TestSharedSeedInterface(t *testing.T) {
	m := newMini(t)
	var cb CircuitBreaker = m.shared(t, fastSettings)
	for range 4 {
		ok, err := cb.Allow(ctx, "hook.example")
		require.NoError(t, err)
		require.True(t, ok)
		require.NoError(t, cb.RecordFailure(ctx, "hook.example"))
	}
	st, err := cb.State(ctx, "hook.example")
	require.NoError(t, err)
	require.Equal(t, Open, st)
	ok, err := cb.Allow(ctx, "hook.example")
	require.NoError(t, err)
	require.False(t, ok)

	m.advance(time.Second)
	ok, err = cb.Allow(ctx, "hook.example")
	require.NoError(t, err)
	require.True(t, ok, "the probe")
	ok, err = cb.Allow(ctx, "hook.example")
	require.NoError(t, err)
	require.False(t, ok, "one probe")
	require.NoError(t, cb.RecordSuccess(ctx, "hook.example"), "with the probe's lease")
	st, err = cb.State(ctx, "hook.example")
	require.NoError(t, err)
	assert.Equal(t, Closed, st)
}

type cancelKey struct{}

// cancelHook cancels the context of a script call as it is sent.
type cancelHook struct{}

func (cancelHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (cancelHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cancel, ok := ctx.Value(cancelKey{}).(context.CancelFunc); ok {
			cancel()
			cmd.SetErr(ctx.Err())
			return ctx.Err()
		}
		return next(ctx, cmd)
	}
}
func (cancelHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

func TestSharedStatsCountByState(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings)
	trip(t, b, "k")
	_, _ = b.Acquire(ctx, "k")
	m.advance(time.Second)
	p, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	_, _ = b.Acquire(ctx, "k")
	require.NoError(t, p.Done(ctx, Success))
	s := b.Stats()
	assert.Equal(t, [3]uint64{4, 0, 1}, s.Granted)
	assert.Equal(t, [3]uint64{0, 2, 1}, s.Rejected)
	assert.Equal(t, [3]uint64{4, 0, 0}, s.Failures)
	assert.Equal(t, [3]uint64{0, 0, 1}, s.Successes)
	assert.Equal(t, 0, s.Open, "closed by the probe")
	trip(t, b, "k")
	assert.Equal(t, 1, b.Stats().Open)
	assert.Equal(t, fmt.Sprint(Closed), fmt.Sprint(s.Store))
}

func TestNewSharedRefusesATypedNilClient(t *testing.T) {
	var c *redis.Client
	var cc *redis.ClusterClient
	for name, client := range map[string]redis.Scripter{"client": c, "cluster": cc} {
		_, err := NewShared(client, SharedSettings{})
		assert.ErrorIs(t, err, ErrInvalidSettings, name)
	}
}

// TestSharedFarOpenTimeIsBroughtBack: an open time or a probe lease further
// ahead than the settings allow (Redis's clock stepped back after a
// failover, or a planted value) holds the breaker for at most MaxOpenFor or
// ProbeTimeout, not until Redis's clock catches up.
func TestSharedFarOpenTimeIsBroughtBack(t *testing.T) {
	t.Run("clock stepped back", func(t *testing.T) {
		m := newMini(t)
		b := m.shared(t, fastSettings)
		trip(t, b, "k")
		m.at -= time.Hour // a failover to a server an hour behind
		m.advance(time.Second)
		_, err := b.Acquire(ctx, "k")
		require.ErrorIs(t, err, ErrOpen)
		m.advance(time.Second)
		p, err := b.Acquire(ctx, "k")
		require.NoError(t, err, "open for at most MaxOpenFor after the step")
		assert.True(t, p.Probe())
	})
	t.Run("planted lease", func(t *testing.T) {
		m := newMini(t)
		b := m.shared(t, fastSettings)
		far := strconv.FormatInt(epochUs+int64(365*24*time.Hour/time.Microsecond), 10)
		m.mr.HSet(b.Key("k"), "v", "1", "s", "2", "g", "2", "l1", "77", "e1", far)
		_, err := b.Acquire(ctx, "k")
		require.ErrorIs(t, err, ErrOpen)
		m.advance(fastSettings.ProbeTimeout)
		p, err := b.Acquire(ctx, "k")
		require.NoError(t, err, "the lease lasts at most ProbeTimeout")
		assert.True(t, p.Probe())
	})
	t.Run("planted used lease", func(t *testing.T) {
		m := newMini(t)
		b := m.shared(t, fastSettings)
		far := strconv.FormatInt(epochUs+int64(365*24*time.Hour/time.Microsecond), 10)
		m.mr.HSet(b.Key("k"), "v", "1", "s", "2", "g", "2", "l1", "-", "e1", far, "hs", "0")
		_, err := b.Acquire(ctx, "k")
		require.ErrorIs(t, err, ErrOpen)
		m.advance(fastSettings.ProbeTimeout)
		p, err := b.Acquire(ctx, "k")
		require.NoError(t, err, "a used lease holds its slot for at most ProbeTimeout")
		require.True(t, p.Probe())
		require.NoError(t, p.Done(ctx, Success))
		st, err := b.State(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, Closed, st, "the probe's success closes it")
	})
}

// panickyScripter is a client whose EvalSha fails (mode 1), panics
// (mode 2), as a client's hook may, hangs until its caller gives up (mode
// 3), as a client of a hung Redis does, or passes on (mode 0).
type panickyScripter struct {
	redis.Scripter
	mode atomic.Int32
}

func (p *panickyScripter) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	switch p.mode.Load() {
	case 1:
		c := redis.NewCmd(ctx)
		c.SetErr(errors.New("down"))
		return c
	case 2:
		panic("a client hook panics")
	case 3:
		<-ctx.Done()
		c := redis.NewCmd(ctx)
		c.SetErr(ctx.Err())
		return c
	}
	return p.Scripter.EvalSha(ctx, sha, keys, args...)
}
