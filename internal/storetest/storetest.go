// Package storetest holds a tollgate.Store test double for the tests of
// tollgate's packages and of the adapter modules: a store that fails, or
// is slow, when a test says so.
//
// It imports tollgate, so the root package's own tests (package tollgate)
// cannot use it and keep a double of their own.
package storetest

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/tollgate-go/tollgate"
)

// Flaky is a tollgate.Store that passes its calls to a MemoryStore of its
// own, and fails or is slow while a test says so. Not being a
// *tollgate.MemoryStore, it gets from a Limiter what a RedisStore gets: a
// breaker, a denial cache, and its calls timed and counted.
//
// Make one with NewFlaky or Down. A Flaky is safe for concurrent use.
type Flaky struct {
	inner *tollgate.MemoryStore

	mu     sync.Mutex
	err    error
	delay  time.Duration
	onTake func()
	calls  int
}

var _ tollgate.Store = (*Flaky)(nil)

// NewFlaky returns a Flaky that works, on an empty MemoryStore.
func NewFlaky() *Flaky { return &Flaky{inner: tollgate.NewMemoryStore()} }

// Down returns a Flaky that fails every call with err, as a store out of
// reach does, until Fail(nil).
func Down(err error) *Flaky {
	f := NewFlaky()
	f.Fail(err)
	return f
}

// Fail makes every later call fail with err; Fail(nil) ends the failure.
// The MemoryStore keeps what it held, so the buckets are as they were
// before the failure.
func (f *Flaky) Fail(err error) {
	f.mu.Lock()
	f.err = err
	f.mu.Unlock()
}

// Slow makes every later Take sleep d before it answers, or fails; Slow(0)
// ends it.
func (f *Flaky) Slow(d time.Duration) {
	f.mu.Lock()
	f.delay = d
	f.mu.Unlock()
}

// OnTake makes every later Take call fn after its delay and before it
// answers or fails, so that a test can act in the middle of a call (cancel
// the caller's context, say). OnTake(nil) removes it.
func (f *Flaky) OnTake(fn func()) {
	f.mu.Lock()
	f.onTake = fn
	f.mu.Unlock()
}

// Calls returns the number of Take calls so far, failed ones included.
func (f *Flaky) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// Take fails with the error set by Fail, if any, and else takes from the
// MemoryStore.
func (f *Flaky) Take(ctx context.Context, key string, cost int64, plans []tollgate.Plan) (tollgate.Result, error) {
	f.mu.Lock()
	f.calls++
	err, delay, onTake := f.err, f.delay, f.onTake
	f.mu.Unlock()
	// Outside the lock, so that a slow call or the hook holds up no other
	// call and the hook may call back into f.
	if delay > 0 {
		time.Sleep(delay)
	}
	if onTake != nil {
		onTake()
	}
	if err != nil {
		return tollgate.Result{}, err
	}
	return f.inner.Take(ctx, key, cost, plans)
}

// Reset fails with the error set by Fail, if any, and else resets key in
// the MemoryStore.
func (f *Flaky) Reset(ctx context.Context, key string, plans []tollgate.Plan) error {
	f.mu.Lock()
	err := f.err
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return f.inner.Reset(ctx, key, plans)
}

// TimeoutError is a net.Error that timed out, as a client's read deadline
// gives: a Limiter counts it in the "timeout" class of store errors.
type TimeoutError struct{}

var _ net.Error = TimeoutError{}

// Error returns "i/o timeout", as a read past its deadline says.
func (TimeoutError) Error() string { return "i/o timeout" }

// Timeout reports true: the error is a timeout.
func (TimeoutError) Timeout() bool { return true }

// Temporary reports true, as the net package's timeouts do.
func (TimeoutError) Temporary() bool { return true }
