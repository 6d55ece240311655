package grpclimit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

// pacedClient returns a client of the (unlimited) test service whose
// calls are paced by lim.
func pacedClient(t *testing.T, lim Waiter, opts ...ClientOption) (*testService, testgrpc.TestServiceClient) {
	svc, conn := serve(t, nil,
		grpc.WithChainUnaryInterceptor(UnaryClientInterceptor(lim, PerMethod(Key("upstream:test")), opts...)),
		grpc.WithChainStreamInterceptor(StreamClientInterceptor(lim, Key("upstream:test"), opts...)))
	return svc, testgrpc.NewTestServiceClient(conn)
}

func TestClientPaces(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	_, client := pacedClient(t, lim, WithClientPlans("msgs"))
	msgs, _ := lim.Plan("msgs")
	const n = 8
	start := time.Now()
	for range n {
		_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
		require.NoError(t, err)
	}
	// n calls from a full bucket need n-Capacity tokens to accrue.
	assert.GreaterOrEqual(t, time.Since(start), time.Duration(float64(n-msgs.Capacity)/msgs.Rate*float64(time.Second))-time.Millisecond)
	peek, err := lim.Peek(context.Background(), emptyCall+"|upstream:test", "msgs")
	require.NoError(t, err)
	assert.Zero(t, peek.Remaining)
}

func TestClientFailsFastPastTheDeadline(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := pacedClient(t, lim, WithClientPlans("slow"))
	_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
	assert.Less(t, time.Since(start), 10*time.Second, "waited for a token an hour away")
	st := status.Convert(err)
	assert.Equal(t, codes.ResourceExhausted, st.Code())
	assert.Contains(t, st.Message(), "client")
	ri, _, ei := details(t, err)
	assert.Greater(t, ri.GetRetryDelay().AsDuration(), 50*time.Minute)
	assert.Equal(t, "slow", ei.GetMetadata()["plan"])
	assert.Equal(t, 1, svc.handled(), "the call that could not wait was sent")

	// Streams likewise: they take their own key's token.
	_, err = upload(ctx, client, 1)
	require.NoError(t, err)
	_, err = client.StreamingInputCall(ctx)
	assert.Equal(t, codes.ResourceExhausted, status.Code(err))
}

func TestClientCancelledWhileWaiting(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := pacedClient(t, lim, WithClientPlans("slow"))
	_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
	assert.Equal(t, codes.Canceled, status.Code(err))
	assert.Equal(t, 1, svc.handled())
}

func TestClientStoreOutage(t *testing.T) {
	lim := newLimiter(t, storetest.Down(errors.New("down")), tollgate.WithFailurePolicy(breaker.FailClosed))
	svc, client := pacedClient(t, lim)
	_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
	assert.Equal(t, codes.Unavailable, status.Code(err))
	_, err = client.StreamingInputCall(context.Background())
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Zero(t, svc.handled())
}

func TestClientCostAndStreams(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	_, client := pacedClient(t, lim, WithClientPlans("daily"),
		WithClientCost(func(_ context.Context, _ string, req any) int64 {
			if req == nil {
				return 10 // a stream
			}
			return 3
		}))
	_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
	require.NoError(t, err)
	_, err = upload(context.Background(), client, 2)
	require.NoError(t, err)
	peek, err := lim.Peek(context.Background(), emptyCall+"|upstream:test", "daily")
	require.NoError(t, err)
	assert.Equal(t, int64(997), peek.Remaining)
	peek, err = lim.Peek(context.Background(), "upstream:test", "daily")
	require.NoError(t, err)
	assert.Equal(t, int64(990), peek.Remaining)
}

// giveUp is a Waiter that denies without an error.
type giveUp struct{}

func (giveUp) Wait(context.Context, string, int64, ...string) (tollgate.Result, error) {
	return tollgate.Result{Plan: "p"}, nil
}

func TestClientKeyAndWaiterErrors(t *testing.T) {
	i := UnaryClientInterceptor(giveUp{}, ByMetadata("x-api-key"))
	invoked := false
	invoker := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		invoked = true
		return nil
	}
	err := i(context.Background(), emptyCall, nil, nil, nil, invoker)
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	err = UnaryClientInterceptor(giveUp{}, Key("k"))(context.Background(), emptyCall, nil, nil, nil, invoker)
	assert.Equal(t, codes.ResourceExhausted, status.Code(err))
	assert.False(t, invoked)
}

// TestClientConcurrencyPlanPanics: a client interceptor waits for tokens
// and holds no permit, so a concurrency plan among its plans, which every
// call would fail on, is a wiring mistake caught at construction.
func TestClientConcurrencyPlanPanics(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), permitPlans)
	require.NoError(t, err)
	_, err = l.Wait(context.Background(), "k", 1, "one")
	require.ErrorIs(t, err, tollgate.ErrInvalidPlan, "what every call would get")
	assert.PanicsWithValue(t, `grpclimit: UnaryClientInterceptor: plan "one" is a concurrency plan, whose permits a client interceptor cannot hold`,
		func() { UnaryClientInterceptor(l, Key("k"), WithClientPlans("hourly", "one")) })
	assert.PanicsWithValue(t, `grpclimit: StreamClientInterceptor: plan "inflight" is a concurrency plan, whose permits a client interceptor cannot hold`,
		func() { StreamClientInterceptor(l, Key("k"), WithClientPlans("inflight")) })
	assert.NotPanics(t, func() { UnaryClientInterceptor(l, Key("k"), WithClientPlans("hourly")) })
	// Without WithClientPlans, a call waits on the default plan: "one".
	const msg = `: the default plan "one" is a concurrency plan, whose permits a client interceptor cannot hold: name its plans in WithClientPlans`
	assert.PanicsWithValue(t, "grpclimit: UnaryClientInterceptor"+msg, func() { UnaryClientInterceptor(l, Key("k")) })
	assert.PanicsWithValue(t, "grpclimit: StreamClientInterceptor"+msg, func() { StreamClientInterceptor(l, Key("k"), WithClientPlans()) })
}
