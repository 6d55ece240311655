package redisscript

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestCutShort: a call's error is cut short by its caller's context when
// that ended, or when its deadline is within DeadlineSlack and Redis did
// not answer; an answer of Redis is never a deadline's doing.
func TestCutShort(t *testing.T) {
	timeout := errors.New("i/o timeout")
	answer := fmt.Errorf("script: %w", &Error{Class: "OOM"})
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	near := deadlineOnly{time.Now().Add(DeadlineSlack / 2)}
	far, cancelFar := context.WithTimeout(context.Background(), time.Hour)
	defer cancelFar()
	for _, tt := range []struct {
		name     string
		ctx      context.Context
		err      error
		cerr     error
		answered bool
	}{
		{"ended", ended, timeout, context.Canceled, false},
		{"ended, answered", ended, answer, context.Canceled, true},
		{"deadline within the slack", near, timeout, context.DeadlineExceeded, false},
		{"deadline within the slack, answered", near, answer, nil, true},
		{"deadline far", far, timeout, nil, false},
		{"bad reply", far, ErrBadReply, nil, true},
	} {
		cerr, answered := CutShort(tt.ctx, tt.err)
		assert.Equal(t, tt.cerr, cerr, tt.name)
		assert.Equal(t, tt.answered, answered, tt.name)
	}
}

// deadlineOnly is a context whose deadline is at, and which never ends:
// a caller's context a moment before its timer marks it done.
type deadlineOnly struct{ at time.Time }

func (c deadlineOnly) Deadline() (time.Time, bool) { return c.at, true }
func (deadlineOnly) Done() <-chan struct{}         { return nil }
func (deadlineOnly) Err() error                    { return nil }
func (deadlineOnly) Value(any) any                 { return nil }
