package breaker

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type panicky struct {
	redis.Scripter
	mode atomic.Int32 // 0 pass, 1 error, 2 panic
}

func (p *panicky) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	switch p.mode.Load() {
	case 1:
		c := redis.NewCmd(ctx)
		c.SetErr(errors.New("down"))
		return c
	case 2:
		panic("hook")
	}
	return p.Scripter.EvalSha(ctx, sha, keys, args...)
}

func TestScratchProbePanics(t *testing.T) {
	m := newMini(t)
	pc := &panicky{Scripter: m.c}
	b, err := NewShared(pc, fastSettings, WithLogger(nil), WithStoreBreaker(Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	pc.mode.Store(1)
	_, _ = b.Acquire(ctx, "k")
	require.Equal(t, Open, b.health.State())
	time.Sleep(20 * time.Millisecond)
	pc.mode.Store(2)
	assert.Panics(t, func() { _, _ = b.Acquire(ctx, "k") })
	pc.mode.Store(0)
	time.Sleep(20 * time.Millisecond)
	_, _ = b.Acquire(ctx, "k")
	assert.Equal(t, Closed, b.health.State(), "the next call probes and closes it")
}
