package grpclimit

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
)

// upload sends n messages on a StreamingInputCall and returns the number
// the server counted, or the stream's error.
func upload(ctx context.Context, client testgrpc.TestServiceClient, n int, opts ...grpc.CallOption) (int32, error) {
	stream, err := client.StreamingInputCall(ctx, opts...)
	if err != nil {
		return 0, err
	}
	for range n {
		if err := stream.Send(&testgrpc.StreamingInputCallRequest{}); err != nil {
			break // the server ended the stream: CloseAndRecv has its status
		}
	}
	resp, err := stream.CloseAndRecv()
	return resp.GetAggregatedPayloadSize(), err
}

func TestStreamCountsOnceAtOpen(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := limitedServer(t, lim, ByMetadata("x-api-key"), WithPlans("gold"), WithAllowedMetadata(true))
	var header metadata.MD
	got, err := upload(withKey("k"), client, 10, grpc.Header(&header))
	require.NoError(t, err)
	assert.Equal(t, int32(10), got)
	assert.Equal(t, []string{`"gold";r=1;t=1`}, header.Get("ratelimit"))

	peek, err := lim.Peek(context.Background(), "md:x-api-key:k", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(1), peek.Remaining, "10 messages took 1 token")

	_, err = upload(withKey("k"), client, 10)
	require.NoError(t, err)
	var trailer metadata.MD
	_, err = upload(withKey("k"), client, 10, grpc.Trailer(&trailer))
	assert.Equal(t, codes.ResourceExhausted, status.Code(err), "the third stream opens with no token")
	ri, _, _ := details(t, err)
	assert.Positive(t, ri.GetRetryDelay().AsDuration())
	assert.Equal(t, []string{"1"}, trailer.Get("retry-after"))
	assert.Len(t, svc.receivedAt(), 20)
}

// TestPerMessagePacing sends more messages than the plan's burst, and
// checks what the handler received against the bucket's arithmetic:
// between any two messages i < j, no more than Capacity + Rate*(t_j-t_i)
// messages got through. Only lower bounds on time are asserted, which a
// slow machine cannot break.
func TestPerMessagePacing(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := limitedServer(t, lim, ByMetadata("x-api-key"), WithPlans("gold"),
		WithStreamMessages(Pace, nil, "msgs"))
	const n = 12
	start := time.Now()
	got, err := upload(withKey("k"), client, n)
	require.NoError(t, err)
	assert.Equal(t, int32(n), got)

	msgs, _ := lim.Plan("msgs")
	at := svc.receivedAt()
	require.Len(t, at, n)
	const slack = 1.0 // a token's fraction that the microsecond rounding may give
	for i := range at {
		for j := i + 1; j < len(at); j++ {
			passed := float64(j - i + 1)
			allowed := float64(msgs.Capacity) + msgs.Rate*at[j].Sub(at[i]).Seconds() + slack
			assert.LessOrEqual(t, passed, allowed, "messages %d to %d", i, j)
		}
	}
	assert.GreaterOrEqual(t, time.Since(start), time.Duration(float64(n-msgs.Capacity)/msgs.Rate*float64(time.Second))-time.Millisecond)
	stats := lim.Stats()
	require.Equal(t, "msgs", stats.Plans[3].Plan)
	assert.Equal(t, uint64(n), stats.Plans[3].Allowed[tollgate.SourceStore], "one allowed decision per message")
}

func TestPerMessagePacingPastTheDeadline(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := limitedServer(t, lim, ByMetadata("x-api-key"), WithStreamMessages(Pace, nil, "slow"))
	ctx, cancel := context.WithTimeout(withKey("k"), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := upload(ctx, client, 3)
	assert.Equal(t, codes.ResourceExhausted, status.Code(err))
	assert.Less(t, time.Since(start), 10*time.Second, "waited for a token an hour away")
	ri, _, _ := details(t, err)
	assert.Greater(t, ri.GetRetryDelay().AsDuration(), 50*time.Minute)
	assert.Len(t, svc.receivedAt(), 1)
}

func TestPerMessageReject(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := limitedServer(t, lim, ByMetadata("x-api-key"), WithPlans("daily"),
		WithStreamMessages(Reject, func(any) int64 { return 1 }, "gold"))
	var trailer metadata.MD
	_, err := upload(withKey("k"), client, 10, grpc.Trailer(&trailer))
	assert.Equal(t, codes.ResourceExhausted, status.Code(err), "the third message ends the stream")
	assert.Len(t, svc.receivedAt(), 2)
	assert.Equal(t, []string{"1"}, trailer.Get("retry-after"))
	assert.Equal(t, "rate limited (plan gold)", status.Convert(err).Message())
}

func TestPerMessageOutageUnderFailClosed(t *testing.T) {
	stub := &stubLimiter{res: tollgate.Result{Allowed: true}}
	svc, client := limitedServer(t, stub, ByMetadata("x-api-key"), WithStreamMessages(Reject, nil))
	stream, err := client.StreamingInputCall(withKey("k"))
	require.NoError(t, err)
	require.NoError(t, stream.Send(&testgrpc.StreamingInputCallRequest{}))
	require.Eventually(t, func() bool { return len(svc.receivedAt()) == 1 }, 5*time.Second, time.Millisecond)
	stub.mu.Lock()
	stub.err = tollgate.ErrStoreUnavailable
	stub.mu.Unlock()
	_ = stream.Send(&testgrpc.StreamingInputCallRequest{})
	_, err = stream.CloseAndRecv()
	assert.Equal(t, codes.Unavailable, status.Code(err))
}
