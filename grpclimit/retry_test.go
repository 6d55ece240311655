package grpclimit

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"

	"github.com/tollgate-go/tollgate"
)

// retryConfig retries RESOURCE_EXHAUSTED up to 3 attempts, with a backoff
// of 20s: a retry sooner than 16s (the backoff less its jitter) followed
// the server's pushback.
const retryConfig = `{"methodConfig": [{
	"name": [{"service": "grpc.testing.TestService"}],
	"retryPolicy": {
		"maxAttempts": 3,
		"initialBackoff": "20s",
		"maxBackoff": "20s",
		"backoffMultiplier": 1,
		"retryableStatusCodes": ["RESOURCE_EXHAUSTED"]
	}
}]}`

// seqLimiter answers its decisions from a list, then allows.
type seqLimiter struct {
	mu  sync.Mutex
	seq []tollgate.Result
}

func (s *seqLimiter) Allow(ctx context.Context, key string, plans ...string) (tollgate.Result, error) {
	return s.AllowN(ctx, key, 1, plans...)
}

func (s *seqLimiter) AllowN(context.Context, string, int64, ...string) (tollgate.Result, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.seq) == 0 {
		return tollgate.Result{Allowed: true, Plan: "p", Limit: 1}, nil
	}
	r := s.seq[0]
	s.seq = s.seq[1:]
	return r, nil
}

// retryingClient serves l behind UnaryServerInterceptor and an attempt
// counter, to a client whose retry policy is retryConfig.
func retryingClient(t *testing.T, l tollgate.RateLimiter, opts ...Option) (*testService, *atomic.Int32, testgrpc.TestServiceClient) {
	attempts := new(atomic.Int32)
	count := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		attempts.Add(1)
		return handler(ctx, req)
	}
	svc, conn := serve(t, []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(count, UnaryServerInterceptor(l, ByMetadata("x-api-key"), opts...)),
	}, grpc.WithDefaultServiceConfig(retryConfig))
	return svc, attempts, testgrpc.NewTestServiceClient(conn)
}

func TestRetryPolicyWaitsThePushback(t *testing.T) {
	const retryAfter = 300 * time.Millisecond
	l := &seqLimiter{seq: []tollgate.Result{{Plan: "p", Limit: 1, RetryAfter: retryAfter}}}
	svc, attempts, client := retryingClient(t, l)
	ctx, cancel := context.WithTimeout(withKey("k"), 15*time.Second)
	defer cancel()

	start := time.Now()
	_, err := client.EmptyCall(ctx, &testgrpc.Empty{})
	elapsed := time.Since(start)
	require.NoError(t, err, "the retry is allowed")
	assert.Equal(t, int32(2), attempts.Load(), "a denied attempt and its retry")
	assert.Equal(t, 1, svc.handled())
	assert.GreaterOrEqual(t, elapsed, retryAfter, "the client retried before the RetryAfter")
	assert.Less(t, elapsed, 16*time.Second, "the client waited its own backoff, not the pushback")
}

func TestRetryPolicyWithALimiter(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "fast", Capacity: 1, Rate: 5}})
	require.NoError(t, err)
	svc, attempts, client := retryingClient(t, lim)
	ctx, cancel := context.WithTimeout(withKey("k"), 15*time.Second)
	defer cancel()
	for range 3 {
		_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
		require.NoError(t, err, "each retry comes when the token is there")
	}
	assert.Equal(t, 3, svc.handled())
	// Calls 2 and 3 come before their tokens, unless the machine stalls
	// for 200ms, and each is denied once: its retry, at the pushback,
	// finds the token. None is denied twice.
	assert.LessOrEqual(t, attempts.Load(), int32(5))
}

func TestRetryPolicyWithoutPushback(t *testing.T) {
	l := &seqLimiter{seq: []tollgate.Result{{Plan: "p", Limit: 1, RetryAfter: time.Millisecond}}}
	_, attempts, client := retryingClient(t, l, WithPushback(false))
	// Without pushback the client's 20s backoff applies, past this deadline.
	ctx, cancel := context.WithTimeout(withKey("k"), 500*time.Millisecond)
	defer cancel()
	_, err := client.EmptyCall(ctx, &testgrpc.Empty{})
	require.Error(t, err)
	assert.Equal(t, int32(1), attempts.Load())
}
