package tollgate

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sharedMemory returns two Limiters of plans over one MemoryStore, whose
// clock is *now, remembering no denial.
func sharedMemory(t *testing.T, now *int64, plans []Plan) (m *MemoryStore, a, b *Limiter) {
	t.Helper()
	m = newClockedMemoryStore(now)
	a, err := New(m, plans, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	b, err = New(m, plans, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	return m, a, b
}

// TestMemoryStoreReset: Reset drops the named plans' buckets alone, and
// marks the key.
func TestMemoryStoreReset(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore()
	other := Plan{Name: "other", Capacity: 4, Rate: 1}
	_, err := m.Take(ctx, "k", 4, []Plan{gold, other})
	require.NoError(t, err)
	require.NoError(t, m.Reset(ctx, "k", []Plan{gold}))
	r, err := m.Take(ctx, "k", 0, []Plan{gold, other})
	require.NoError(t, err)
	assert.Equal(t, []int64{4, 0}, []int64{r.PlanResults()[0].Remaining, r.PlanResults()[1].Remaining}, "only the named plan resets")
	require.NoError(t, m.Reset(ctx, "k", []Plan{other}))
	assert.Equal(t, 0, m.Len(), "the key's mark is not a key")
	marked := func(key string) bool {
		s, _ := m.shard(key)
		_, ok := s.marks.book.marks[key]
		return ok
	}
	assert.True(t, marked("k"), "marked as reset")
	require.NoError(t, m.Reset(ctx, "x", nil))
	assert.False(t, marked("x"), "a Reset of no plan changes nothing")
}

// TestResetByAnotherLimiterOnOneMemoryStoreVoidsTheRefund: of a plan of
// 1,000, Limiter A reserves 1,000, Limiter B, on the same MemoryStore,
// resets the key and admits 1,000, then A cancels. A's refund would fill
// the bucket B's Reset filled a second time: before, A's Limiter knew of
// no Reset, the Cancel refunded 1,000, and 2,000 passed at one instant.
func TestResetByAnotherLimiterOnOneMemoryStoreVoidsTheRefund(t *testing.T) {
	now := t0
	_, a, b := sharedMemory(t, &now, []Plan{daylong})
	resetByAnotherVoidsTheRefund(t, a, b, func() { now++ })
}

// TestMemoryStoreResetVoidsTheRefundOfAnEarlierHold: MemoryStore.Reset,
// called by the store's user and no Limiter, voids the refunds of the
// holds of the key taken before it, in the same µs too, and of no other:
// a hold taken after it, and one of another key, are refunded. Before,
// every refund landed: 900 back in the bucket the Reset filled, of which
// 800 were taken since.
func TestMemoryStoreResetVoidsTheRefundOfAnEarlierHold(t *testing.T) {
	ctx := context.Background()
	now := t0
	m, a, _ := sharedMemory(t, &now, []Plan{daylong})
	reserve := func(key string, n int64) *Reservation {
		rv, err := a.Reserve(ctx, key, n)
		require.NoError(t, err)
		require.True(t, rv.OK())
		return rv
	}
	before, other := reserve("k", 400), reserve("other", 400)
	now++
	sameMicro := reserve("k", 300)
	require.NoError(t, m.Reset(ctx, "k", []Plan{daylong}))
	now++
	after := reserve("k", 200)
	res, err := a.AllowN(ctx, "k", 800)
	require.NoError(t, err)
	require.True(t, res.Allowed, "Reset filled the bucket")
	for _, tt := range []struct {
		name     string
		rv       *Reservation
		refunded int64
	}{{"before", before, 0}, {"in the Reset's µs", sameMicro, 0}, {"after", after, 200}, {"another key", other, 400}} {
		st, err := tt.rv.Cancel(ctx)
		require.NoError(t, err, tt.name)
		assert.Equal(t, tt.refunded, st.Refunded, tt.name)
	}
	res, err = a.Peek(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, int64(200), res.Remaining, "the refund of the hold taken after the Reset alone")
}

// TestMemoryStoreResetKeepsTheMarkForTheLongestHold: a mark is kept 15
// minutes after MemoryStore.Reset, a Limiter's longest hold after its
// Reset if that is longer, and never less than a mark already kept. A
// Limiter whose holds live a millisecond resets the key of another's
// reservation, a minute passes, and the Cancel still refunds nothing.
func TestMemoryStoreResetKeepsTheMarkForTheLongestHold(t *testing.T) {
	ctx := context.Background()
	now := t0
	m, a, _ := sharedMemory(t, &now, []Plan{llm})
	until := func() time.Duration {
		s, _ := m.shard("k")
		return time.Duration(s.marks.book.marks["k"].until-now) * time.Microsecond
	}
	require.NoError(t, m.Reset(ctx, "k", []Plan{llm}))
	assert.Equal(t, minResetKeep, until())
	long, err := New(m, []Plan{llm}, WithLogger(nil), WithHoldTTL(time.Hour))
	require.NoError(t, err)
	require.NoError(t, long.Reset(ctx, "k"))
	assert.Equal(t, time.Hour, until())
	require.NoError(t, m.Reset(ctx, "k", []Plan{llm}))
	assert.Equal(t, time.Hour, until(), "never shortened by a Reset with a shorter one")

	now++
	rv, err := a.Reserve(ctx, "k", 1000)
	require.NoError(t, err)
	now++
	short, err := New(m, []Plan{llm}, WithLogger(nil), WithHoldTTL(time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, short.Reset(ctx, "k"))
	now += time.Minute.Microseconds()
	st, err := rv.Cancel(ctx)
	require.NoError(t, err)
	assert.Zero(t, st.Refunded)
}

// TestMemoryStoreResetMarksStayBounded: past its limit of keys marked, a
// shard forgets the marks past their time, and, if more than half of the
// limit are recent, every mark, voiding the refunds of every hold of its
// keys taken before: it under-admits, never over-admits.
func TestMemoryStoreResetMarksStayBounded(t *testing.T) {
	var ms memMarks
	const limit = 64
	keep := time.Minute.Microseconds()
	ms.mark("k", t0, t0+keep, limit)
	assert.True(t, ms.voids("k", t0, t0), "a hold taken in the Reset's µs")
	assert.False(t, ms.voids("k", t0+1, t0+1), "a hold taken after the Reset")
	for i := range limit - 1 {
		ms.mark("old-"+strconv.Itoa(i), t0, t0+keep, limit)
	}
	later := t0 + 2*keep
	ms.mark("new", later, later+keep, limit)
	assert.Len(t, ms.book.marks, 1, "the marks past their time are forgotten")
	assert.False(t, ms.voids("k", t0+1, later), "forgotten with its time: no hold taken before it is left")

	held := later + 1
	for i := range limit {
		ms.mark("recent-"+strconv.Itoa(i), later+2, later+2+keep, limit)
	}
	assert.LessOrEqual(t, len(ms.book.marks), limit/2+1)
	assert.True(t, ms.voids("k", held, later+3), "a forgotten mark may have been k's: no refund")
	assert.False(t, ms.voids("k", later+3, later+3), "a hold taken since keeps its refund")
}

// TestMemoryStoreResetRacesWithSettle: Limiter B resets a key and takes
// its 1,000 tokens while Limiter A cancels its reservation of the 1,000
// tokens the key held before. Whichever comes first, the bucket B's Reset
// filled ends empty: a refund that looked for the mark before the Reset
// and landed after it would leave 1,000 in it.
func TestMemoryStoreResetRacesWithSettle(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore()
	a, err := New(m, []Plan{daylong}, WithLogger(nil))
	require.NoError(t, err)
	b, err := New(m, []Plan{daylong}, WithLogger(nil))
	require.NoError(t, err)
	for i := range 200 {
		key := "k" + strconv.Itoa(i)
		rv, err := a.Reserve(ctx, key, 1000)
		require.NoError(t, err)
		require.True(t, rv.OK())
		var wg sync.WaitGroup
		wg.Go(func() {
			assert.NoError(t, b.Reset(ctx, key))
			res, err := b.AllowN(ctx, key, 1000)
			assert.NoError(t, err)
			assert.True(t, res.Allowed, "Reset filled the bucket")
		})
		_, err = rv.Cancel(ctx)
		require.NoError(t, err)
		wg.Wait()
		res, err := a.Peek(ctx, key)
		require.NoError(t, err)
		require.Zero(t, res.Remaining, "round %d", i)
	}
}

// TestMemoryStoreDecisionAfterAResetOfOnePlanReadsTheClockAgain drains
// both plans of a key, one token a second each, then has a decision on
// the key read the clock and wait for a second, while a Reset of one
// plan, which keeps the key's entry for the other, fills that plan's
// bucket. The decision goes on after the Reset and takes the token: had
// it decided at the time it read, a second before the Reset, its bucket
// would be stamped a second early and give a second token at the
// Reset's instant, 2 admitted at once of a plan of 1.
func TestMemoryStoreDecisionAfterAResetOfOnePlanReadsTheClockAgain(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := newClockedMemoryStore(&now)
	p, other := Plan{Name: "p", Capacity: 1, Rate: 1}, Plan{Name: "other", Capacity: 1, Rate: 1}
	r, err := m.Take(ctx, "k", 1, []Plan{p, other})
	require.NoError(t, err)
	require.True(t, r.Allowed)
	wait := true
	m.fakeNow = func() int64 {
		if !wait {
			return now
		}
		wait = false
		read := now // the decision reads the clock here, and waits
		now += 1_000_000
		require.NoError(t, m.Reset(ctx, "k", []Plan{p}))
		return read
	}
	r, err = m.Take(ctx, "k", 1, []Plan{p})
	require.NoError(t, err)
	assert.False(t, wait)
	assert.True(t, r.Allowed, "the Reset filled p")
	r, err = m.Take(ctx, "k", 1, []Plan{p})
	require.NoError(t, err)
	assert.False(t, r.Allowed, "p's one token since the Reset was taken; a second is not there")
}

// TestMemoryStoreHoldTakenAfterAResetIsRefunded: a Reserve on a key whose
// entry a MemoryStore.Reset of one of its plans keeps, that reads the
// clock while the Reset holds the key's lock and takes the lock after it,
// is decided after the Reset, on the bucket it filled: its Cancel is
// refunded. The clock advances a µs at every reading, as a real one does.
// Before: the hold was dated with the reading before the Reset's, at or
// before the mark, and refunded nothing (0 of 500).
func TestMemoryStoreHoldTakenAfterAResetIsRefunded(t *testing.T) {
	ctx := context.Background()
	other := Plan{Name: "other", Capacity: 10, Rate: 1}
	var now atomic.Int64
	now.Store(t0)
	var hook atomic.Pointer[func()]
	m := NewMemoryStore()
	m.fakeNow = func() int64 {
		if h := hook.Load(); h != nil {
			(*h)()
		}
		return now.Add(1)
	}
	l, err := New(m, []Plan{daylong, other}, WithLogger(nil))
	require.NoError(t, err)
	_, err = l.AllowN(ctx, "k", 1, daylong.Name, other.Name)
	require.NoError(t, err)

	resetting, release, read := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	inReset := func() { once.Do(func() { close(resetting); <-release }) }
	hook.Store(&inReset)
	var wg sync.WaitGroup
	wg.Go(func() { assert.NoError(t, m.Reset(ctx, "k", []Plan{daylong})) })
	<-resetting // the Reset holds the key's lock, and reads the clock once released
	var readOnce sync.Once
	inReserve := func() { readOnce.Do(func() { close(read) }) }
	hook.Store(&inReserve)
	var rv *Reservation
	wg.Go(func() {
		var err error
		rv, err = l.Reserve(ctx, "k", 500, daylong.Name)
		assert.NoError(t, err)
	})
	<-read // the Reserve read the clock, and waits for the key's lock
	hook.Store(nil)
	close(release)
	wg.Wait()
	require.True(t, rv.OK())
	assert.Equal(t, int64(500), rv.Result().Remaining, "decided on the bucket the Reset filled")
	st, err := rv.Cancel(ctx)
	require.NoError(t, err)
	assert.Equal(t, int64(500), st.Refunded, "taken after the Reset, from the bucket it filled")
}
