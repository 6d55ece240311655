package grpclimit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
)

func TestOptions(t *testing.T) {
	ctx := incoming(nil, "x-api-key", "k")
	t.Run("method plans", func(t *testing.T) {
		stub := &stubLimiter{res: tollgate.Result{Allowed: true}}
		i := UnaryServerInterceptor(stub, ByMetadata("x-api-key"), WithPlans("gold"), WithMethodPlans(map[string][]string{
			unaryCall:                    {"slow", "daily"},
			"/grpc.testing.TestService/": {"msgs"},
			"/other.Service/":            {"daily"},
		}))
		for _, m := range []string{unaryCall, emptyCall, "/other.Service/Get", "/third.Service/Get"} {
			ran, err := callUnary(ctx, i, m)
			require.NoError(t, err)
			assert.True(t, ran)
		}
		assert.Equal(t, [][]string{{"slow", "daily"}, {"msgs"}, {"daily"}, {"gold"}}, stub.plans)
	})
	t.Run("cost and skip", func(t *testing.T) {
		stub := &stubLimiter{res: tollgate.Result{Allowed: true}}
		i := UnaryServerInterceptor(stub, ByMetadata("x-api-key"),
			WithCost(func(_ context.Context, m string, req any) int64 { return int64(len(m)) }),
			WithSkip(func(_ context.Context, m string) bool { return m == emptyCall }))
		ran, err := callUnary(context.Background(), i, emptyCall) // skipped: no key needed
		require.NoError(t, err)
		assert.True(t, ran)
		_, err = callUnary(ctx, i, unaryCall)
		require.NoError(t, err)
		assert.Equal(t, []int64{int64(len(unaryCall))}, stub.costs)
		assert.Equal(t, []string{"md:x-api-key:k"}, stub.keys)
	})
	t.Run("a bad cost is Internal, not a panic", func(t *testing.T) {
		lim := newLimiter(t, tollgate.NewMemoryStore())
		for _, cost := range []int64{0, -1, 3} {
			i := UnaryServerInterceptor(lim, Key("k"), WithPlans("gold"),
				WithCost(func(context.Context, string, any) int64 { return cost }))
			_, err := callUnary(context.Background(), i, emptyCall)
			assert.Equal(t, codes.Internal, status.Code(err), "cost %d", cost)
		}
	})
	t.Run("a MessageMode that is none panics", func(t *testing.T) {
		lim := newLimiter(t, tollgate.NewMemoryStore())
		for _, mode := range []MessageMode{0, 3} {
			assert.PanicsWithValue(t, fmt.Sprintf("grpclimit: StreamServerInterceptor: WithStreamMessages: unknown MessageMode %d", mode),
				func() { StreamServerInterceptor(lim, Key("k"), WithStreamMessages(mode, nil, "gold")) })
		}
	})
	t.Run("denied and error statuses", func(t *testing.T) {
		stub := &stubLimiter{res: tollgate.Result{Plan: "gold"}}
		i := UnaryServerInterceptor(stub, Key("k"),
			WithDeniedStatus(func(context.Context, tollgate.Result) *status.Status { return status.New(codes.Unavailable, "later") }))
		_, err := callUnary(context.Background(), i, emptyCall)
		assert.Equal(t, codes.Unavailable, status.Code(err))
		i = UnaryServerInterceptor(stub, ByMetadata("x-api-key"),
			WithErrorStatus(func(context.Context, error) *status.Status { return status.New(codes.Unauthenticated, "who?") }))
		_, err = callUnary(context.Background(), i, emptyCall)
		assert.Equal(t, codes.Unauthenticated, status.Code(err))
		// nil from the functions means the default.
		i = UnaryServerInterceptor(stub, ByMetadata("x-api-key"),
			WithErrorStatus(func(context.Context, error) *status.Status { return nil }),
			WithDeniedStatus(func(context.Context, tollgate.Result) *status.Status { return nil }))
		_, err = callUnary(context.Background(), i, emptyCall)
		assert.Equal(t, codes.InvalidArgument, status.Code(err))
		_, err = callUnary(ctx, i, emptyCall)
		assert.Equal(t, codes.ResourceExhausted, status.Code(err))
	})
	t.Run("metadata modes and pushback", func(t *testing.T) {
		res := tollgate.Result{Plan: "gold", Limit: 2, RetryAfter: 300 * time.Millisecond, ResetAfter: time.Second}
		lim := newLimiter(t, tollgate.NewMemoryStore())
		s := newServer("t", lim, Key("k"), []Option{WithMetadata(MetadataBoth)})
		assert.Equal(t, []string{"2", "0", "1", "1", "300"}, []string{
			s.deniedMetadata(&res).Get("x-ratelimit-limit")[0], s.deniedMetadata(&res).Get("x-ratelimit-remaining")[0],
			s.deniedMetadata(&res).Get("x-ratelimit-reset")[0], s.deniedMetadata(&res).Get("retry-after")[0],
			s.deniedMetadata(&res).Get("grpc-retry-pushback-ms")[0]})
		s = newServer("t", lim, Key("k"), []Option{WithMetadata(MetadataNone), WithPushback(false)})
		assert.Equal(t, metadata.MD{"retry-after": {"1"}}, s.deniedMetadata(&res))
		assert.Nil(t, s.allowedMetadata(&res))
		s = newServer("t", lim, Key("k"), nil)
		assert.Nil(t, s.allowedMetadata(&res), "allowed calls get no metadata by default")
		s = newServer("t", lim, Key("k"), []Option{WithAllowedMetadata(true)})
		assert.Len(t, s.allowedMetadata(&res), 2)
	})
}
