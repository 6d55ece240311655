package tollgate

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
)

// reentrantLog is a log handler that asks its Limiter for a decision on
// each record, as one that rate-limits its lines with tollgate does,
// and, on the line of a recovery, finds the store failing again.
type reentrantLog struct {
	logCounter
	l *Limiter
	f *flakyStore
}

func (h *reentrantLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level == slog.LevelInfo {
		h.f.fail(errors.New("down again")) // a flapping store
	}
	if _, err := h.l.Allow(ctx, "log-lines"); err != nil {
		return err
	}
	return h.logCounter.Handle(ctx, r)
}

// TestOutageLogHandlerMayCallTheLimiter: the outage's lines are logged
// outside every lock, so that a handler that calls back into the Limiter,
// whose call trips the breaker again, does not deadlock; and the lines
// still alternate.
func TestOutageLogHandlerMayCallTheLimiter(t *testing.T) {
	f := newFlakyStore()
	h := &reentrantLog{f: f}
	l, err := New(f, testPlans, WithLogger(slog.New(h)), WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Millisecond}))
	require.NoError(t, err)
	h.l = l
	done := make(chan struct{})
	go func() {
		defer close(done)
		ctx := context.Background()
		f.fail(errors.New("down"))
		_, _ = l.Allow(ctx, "k") // trips: the warning
		f.fail(nil)
		for i := 0; i < 1000 && h.count() < 3; i++ {
			time.Sleep(time.Millisecond)
			_, _ = l.Allow(ctx, "k") // recovers: the info line, whose handler trips it again
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("deadlocked: the handler's call waits for the lock its own line is logged under")
	}
	assert.Equal(t, []slog.Level{slog.LevelWarn, slog.LevelInfo, slog.LevelWarn}, h.levels)
}

// panickyLog is a log handler that panics on its first record.
type panickyLog struct {
	logCounter
	panicked bool
}

func (h *panickyLog) Handle(ctx context.Context, r slog.Record) error {
	if !h.panicked {
		h.panicked = true
		panic("handler broke")
	}
	return h.logCounter.Handle(ctx, r)
}

// TestOutageLinesSurviveAPanickingHandler: a log handler that panics takes
// its line with it, and the panic goes on up; the next flush logs the
// lines queued after it, and the lock is left as it should be.
func TestOutageLinesSurviveAPanickingHandler(t *testing.T) {
	var o outage
	h := &panickyLog{}
	o.order.Lock()
	o.queue(slog.LevelWarn, "first")
	o.queue(slog.LevelInfo, "second")
	o.order.Unlock()
	assert.PanicsWithValue(t, "handler broke", func() { o.flush(slog.New(h)) })
	o.flush(slog.New(h))
	assert.Equal(t, []slog.Level{slog.LevelInfo}, h.levels)
	require.True(t, o.order.TryLock(), "the lock is free")
	o.order.Unlock()
}
