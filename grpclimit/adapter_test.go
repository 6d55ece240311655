package grpclimit

import (
	"context"

	"testing"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

var _ ratelimit.Limiter = (*MiddlewareLimiter)(nil)

// middlewareServer serves the test service behind go-grpc-middleware's
// interceptors with a MiddlewareLimiter.
func middlewareServer(t *testing.T, m *MiddlewareLimiter) (*testService, testgrpc.TestServiceClient) {
	svc, conn := serve(t, []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(ratelimit.UnaryServerInterceptor(m)),
		grpc.ChainStreamInterceptor(ratelimit.StreamServerInterceptor(m)),
	})
	return svc, testgrpc.NewTestServiceClient(conn)
}

func TestMiddlewareLimiter(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := middlewareServer(t, NewMiddlewareLimiter(lim, PerMethod(ByMetadata("x-api-key")), WithPlans("gold"), WithAllowedMetadata(true)))
	var header metadata.MD
	for range 2 {
		_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{}, grpc.Header(&header))
		require.NoError(t, err)
	}
	assert.Equal(t, []string{`"gold";r=0;t=1`}, header.Get("ratelimit"), "the metadata survives")
	var trailer metadata.MD
	_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{}, grpc.Trailer(&trailer))
	st := status.Convert(err)
	assert.Equal(t, codes.ResourceExhausted, st.Code())
	assert.Contains(t, st.Message(), "rate limited (plan gold)")
	assert.Empty(t, st.Details(), "what the adapter loses: the details")
	assert.Equal(t, []string{"1"}, trailer.Get("retry-after"))
	assert.Len(t, trailer.Get("grpc-retry-pushback-ms"), 1)
	assert.Equal(t, 2, svc.handled())

	// Streams are keyed by their method too.
	_, err = upload(withKey("k"), client, 3)
	require.NoError(t, err)
}

func TestMiddlewareLimiterLosesTheOutageCode(t *testing.T) {
	lim := newLimiter(t, storetest.Down(storetest.TimeoutError{}), tollgate.WithFailurePolicy(breaker.FailClosed))
	m := NewMiddlewareLimiter(lim, ByMetadata("x-api-key"))
	_, client := middlewareServer(t, m)
	_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{})
	st := status.Convert(err)
	assert.Equal(t, codes.ResourceExhausted, st.Code(), "go-grpc-middleware makes every error ResourceExhausted")
	assert.Contains(t, st.Message(), "rate limiter unavailable")
	// Skipped calls pass.
	_, client = middlewareServer(t, NewMiddlewareLimiter(lim, ByMetadata("x-api-key"), WithSkip(func(context.Context, string) bool { return true })))
	_, err = client.EmptyCall(withKey("k"), &testgrpc.Empty{})
	require.NoError(t, err)
}
