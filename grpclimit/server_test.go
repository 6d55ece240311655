package grpclimit

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

// withKey returns a client context that sends x-api-key: key.
func withKey(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "x-api-key", key)
}

// details returns the details of a status error by type.
func details(t *testing.T, err error) (*errdetails.RetryInfo, *errdetails.QuotaFailure, *errdetails.ErrorInfo) {
	t.Helper()
	st, ok := status.FromError(err)
	require.True(t, ok, "not a status: %v", err)
	var ri *errdetails.RetryInfo
	var qf *errdetails.QuotaFailure
	var ei *errdetails.ErrorInfo
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.RetryInfo:
			ri = d
		case *errdetails.QuotaFailure:
			qf = d
		case *errdetails.ErrorInfo:
			ei = d
		default:
			t.Fatalf("unexpected detail %T", d)
		}
	}
	return ri, qf, ei
}

func TestDenialRoundTrips(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	svc, client := limitedServer(t, lim, ByMetadata("x-api-key"), WithPlans("gold", "daily"), WithAllowedMetadata(true))
	ctx := withKey("alice")

	var header metadata.MD
	_, err := client.EmptyCall(ctx, &testgrpc.Empty{}, grpc.Header(&header))
	require.NoError(t, err)
	assert.Equal(t, []string{`"gold";q=2;w=2, "daily";q=1000;w=86400`}, header.Get("ratelimit-policy"))
	assert.Equal(t, []string{`"gold";r=1;t=1, "daily";r=999;t=87`}, header.Get("ratelimit"))
	assert.Empty(t, header.Get("retry-after"))
	_, err = client.EmptyCall(ctx, &testgrpc.Empty{})
	require.NoError(t, err)

	var denyHeader, trailer metadata.MD
	_, err = client.EmptyCall(ctx, &testgrpc.Empty{}, grpc.Header(&denyHeader), grpc.Trailer(&trailer))
	require.Error(t, err)
	assert.Equal(t, 2, svc.handled(), "the denied call reached the handler")
	peek, perr := lim.Peek(context.Background(), "md:x-api-key:alice", "gold", "daily")
	require.NoError(t, perr)

	st := status.Convert(err)
	assert.Equal(t, codes.ResourceExhausted, st.Code())
	assert.Equal(t, "rate limited (plan gold)", st.Message())
	ri, qf, ei := details(t, err)
	require.NotNil(t, ri)
	delay := ri.GetRetryDelay().AsDuration()
	assert.GreaterOrEqual(t, delay, peek.RetryAfter, "RetryDelay below the RetryAfter the Limiter reports")
	assert.LessOrEqual(t, delay, time.Second)
	assert.Positive(t, delay)
	assert.Zero(t, delay%time.Millisecond, "RetryDelay is whole milliseconds")
	require.NotNil(t, qf)
	require.Len(t, qf.GetViolations(), 1)
	assert.Equal(t, "plan:gold", qf.GetViolations()[0].GetSubject())
	assert.Equal(t, "2 tokens, refilled at 1 per second", qf.GetViolations()[0].GetDescription())
	require.NotNil(t, ei)
	assert.Equal(t, "RATE_LIMITED", ei.GetReason())
	assert.Equal(t, "tollgate", ei.GetDomain())
	assert.Equal(t, map[string]string{"plan": "gold"}, ei.GetMetadata())

	// A denial is a trailers-only response, which grpc-go needs to retry
	// it: everything is in the trailer.
	assert.Empty(t, denyHeader)
	assert.Equal(t, []string{"1"}, trailer.Get("retry-after"))
	assert.Equal(t, []string{fmt.Sprint(delay.Milliseconds())}, trailer.Get("grpc-retry-pushback-ms"))
	assert.Equal(t, []string{`"gold";q=2;w=2, "daily";q=1000;w=86400`}, trailer.Get("ratelimit-policy"))
	assert.Equal(t, []string{`"gold";r=0;t=1, "daily";r=998;t=87`}, trailer.Get("ratelimit"))
}

func TestRetryDelayRoundsUpAndIsNeverZero(t *testing.T) {
	for _, tt := range []struct {
		retryAfter time.Duration
		want       time.Duration
		seconds    string
	}{
		{0, time.Millisecond, "1"},
		{-time.Second, time.Millisecond, "1"},
		{time.Nanosecond, time.Millisecond, "1"},
		{time.Microsecond, time.Millisecond, "1"},
		{time.Millisecond, time.Millisecond, "1"},
		{time.Millisecond + time.Microsecond, 2 * time.Millisecond, "1"},
		{999_999 * time.Microsecond, time.Second, "1"},
		{1500 * time.Millisecond, 1500 * time.Millisecond, "2"},
		{time.Hour + time.Nanosecond, time.Hour + time.Millisecond, "3601"},
	} {
		t.Run(tt.retryAfter.String(), func(t *testing.T) {
			res := tollgate.Result{Plan: "gold", Limit: 2, RetryAfter: tt.retryAfter}
			err := DeniedStatus(res, nil).Err()
			ri, _, _ := details(t, err)
			got := ri.GetRetryDelay().AsDuration()
			assert.Equal(t, tt.want, got)
			assert.GreaterOrEqual(t, got, tt.retryAfter)

			// Through the interceptor: the same delay, and retry-after.
			stub := &stubLimiter{res: res}
			i := UnaryServerInterceptor(stub, Key("k"))
			ran, err := callUnary(context.Background(), i, emptyCall)
			assert.False(t, ran)
			ri, _, _ = details(t, err)
			assert.Equal(t, tt.want, ri.GetRetryDelay().AsDuration())
			md := (&server{pushback: true}).deniedMetadata(&res)
			assert.Equal(t, []string{tt.seconds}, md.Get("retry-after"))
			assert.Equal(t, []string{fmt.Sprint(tt.want.Milliseconds())}, md.Get("grpc-retry-pushback-ms"))
		})
	}
}

// TestNoKeyLeaks sends a key that holds a secret and looks for it in
// everything the client gets back: message, details and metadata, on a
// denial, on an outage, and on a key too long to use.
func TestNoKeyLeaks(t *testing.T) {
	const secret = "s3cr3t-Zq81"
	cases := []struct {
		name string
		lim  *tollgate.Limiter
		key  string
		code codes.Code
	}{
		{"denied", newLimiter(t, tollgate.NewMemoryStore()), secret, codes.ResourceExhausted},
		{"outage under FailClosed", newLimiter(t, storetest.Down(storetest.TimeoutError{}), tollgate.WithFailurePolicy(breaker.FailClosed)), secret, codes.Unavailable},
		{"key too long", newLimiter(t, tollgate.NewMemoryStore()), strings.Repeat(secret, 200), codes.InvalidArgument},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, client := limitedServer(t, c.lim, PerMethod(ByMetadata("x-api-key")), WithPlans("slow"), WithMetadata(MetadataBoth), WithAllowedMetadata(true))
			var err error
			var header, trailer metadata.MD
			for range 2 {
				_, err = client.EmptyCall(withKey(c.key), &testgrpc.Empty{}, grpc.Header(&header), grpc.Trailer(&trailer))
				assertNoSecret(t, secret, header, trailer)
			}
			st := status.Convert(err)
			require.Equal(t, c.code, st.Code())
			assert.NotContains(t, st.Message(), secret)
			for _, d := range st.Details() {
				assert.NotContains(t, fmt.Sprint(d), secret)
			}
			assert.NotContains(t, fmt.Sprint(st.Proto()), secret)
		})
	}
}

func assertNoSecret(t *testing.T, secret string, mds ...metadata.MD) {
	t.Helper()
	for _, md := range mds {
		for k, vs := range md {
			assert.NotContains(t, k, secret)
			for _, v := range vs {
				assert.NotContains(t, v, secret)
			}
		}
	}
}

func TestStoreOutage(t *testing.T) {
	down := func() tollgate.Store { return storetest.Down(storetest.TimeoutError{}) }
	t.Run("FailClosed is Unavailable", func(t *testing.T) {
		svc, client := limitedServer(t, newLimiter(t, down(), tollgate.WithFailurePolicy(breaker.FailClosed)), ByMetadata("x-api-key"))
		var trailer metadata.MD
		_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{}, grpc.Trailer(&trailer))
		st := status.Convert(err)
		assert.Equal(t, codes.Unavailable, st.Code())
		assert.Equal(t, "rate limiter unavailable", st.Message())
		assert.Empty(t, st.Details())
		assert.Empty(t, trailer.Get("retry-after"))
		assert.Zero(t, svc.handled())
	})
	t.Run("FailClosed is Unavailable when the store's own deadline passed", func(t *testing.T) {
		// A store bounded by a context of its own (a pool wait, a
		// per-call timeout) fails with context.DeadlineExceeded while
		// the caller's deadline is far: the store's failure, not the
		// caller's deadline.
		timedOut := storetest.Down(fmt.Errorf("pool wait: %w", context.DeadlineExceeded))
		svc, client := limitedServer(t, newLimiter(t, timedOut, tollgate.WithFailurePolicy(breaker.FailClosed)), ByMetadata("x-api-key"))
		ctx, cancel := context.WithTimeout(withKey("k"), time.Minute)
		defer cancel()
		_, err := client.EmptyCall(ctx, &testgrpc.Empty{})
		assert.Equal(t, codes.Unavailable, status.Code(err))
		assert.Zero(t, svc.handled())
	})
	t.Run("the default policy decides on the fallback", func(t *testing.T) {
		svc, client := limitedServer(t, newLimiter(t, down()), ByMetadata("x-api-key"), WithPlans("gold"))
		for range 2 {
			_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{})
			require.NoError(t, err)
		}
		_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{})
		assert.Equal(t, codes.ResourceExhausted, status.Code(err), "the fallback's bucket is empty")
		ri, _, _ := details(t, err)
		assert.Positive(t, ri.GetRetryDelay().AsDuration())
		assert.Equal(t, 2, svc.handled())
	})
	t.Run("FailOpen allows", func(t *testing.T) {
		svc, client := limitedServer(t, newLimiter(t, down(), tollgate.WithFailurePolicy(breaker.FailOpen)), ByMetadata("x-api-key"), WithPlans("slow"))
		for range 3 {
			_, err := client.EmptyCall(withKey("k"), &testgrpc.Empty{})
			require.NoError(t, err)
		}
		assert.Equal(t, 3, svc.handled())
	})
}

func TestErrorStatus(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	bg := context.Background()
	const secret = "s3cr3t"
	for _, tt := range []struct {
		name string
		ctx  context.Context
		err  error
		code codes.Code
	}{
		{"caller cancelled", canceled, fmt.Errorf("x: %w", context.Canceled), codes.Canceled},
		{"caller's deadline", expired, context.DeadlineExceeded, codes.DeadlineExceeded},
		{"context error, context live", bg, context.Canceled, codes.Canceled},
		{"no key", bg, fmt.Errorf("%w: %s", ErrNoKey, secret), codes.InvalidArgument},
		{"invalid key", bg, fmt.Errorf("%w: 2000 bytes", tollgate.ErrInvalidKey), codes.InvalidArgument},
		{"store unavailable", bg, fmt.Errorf("%w: %s", tollgate.ErrStoreUnavailable, secret), codes.Unavailable},
		{"store timed out, caller live", bg, fmt.Errorf("%w: %w", tollgate.ErrStoreUnavailable, context.DeadlineExceeded), codes.Unavailable},
		{"invalid cost", bg, fmt.Errorf("%w: 0", tollgate.ErrInvalidCost), codes.Internal},
		{"unknown plan", bg, tollgate.ErrUnknownPlan, codes.Internal},
		{"anything else", bg, fmt.Errorf("boom %s", secret), codes.Internal},
	} {
		t.Run(tt.name, func(t *testing.T) {
			st := ErrorStatus(tt.ctx, tt.err)
			assert.Equal(t, tt.code, st.Code())
			assert.NotContains(t, st.Message(), secret)

			i := UnaryServerInterceptor(&stubLimiter{err: tt.err}, Key("k"))
			ran, err := callUnary(tt.ctx, i, emptyCall)
			assert.False(t, ran)
			assert.Equal(t, tt.code, status.Code(err))
		})
	}
}

func TestKeyErrorsAreInvalidArgument(t *testing.T) {
	svc, client := limitedServer(t, newLimiter(t, tollgate.NewMemoryStore()), ByMetadata("x-api-key"))
	_, err := client.EmptyCall(context.Background(), &testgrpc.Empty{})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	_, err = client.EmptyCall(withKey(strings.Repeat("k", tollgate.MaxKeyLen)), &testgrpc.Empty{})
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "key over MaxKeyLen with its prefix")
	// The peer of an in-memory connection is no IP address.
	_, client = limitedServer(t, newLimiter(t, tollgate.NewMemoryStore()), ByPeerIP())
	_, err = client.EmptyCall(context.Background(), &testgrpc.Empty{})
	assert.Equal(t, codes.InvalidArgument, status.Code(err))
	assert.Zero(t, svc.handled())
}

func TestServerPanicsOnWiringMistakes(t *testing.T) {
	lim := newLimiter(t, tollgate.NewMemoryStore())
	key := Key("k")
	for name, f := range map[string]func(){
		"nil limiter":              func() { UnaryServerInterceptor(nil, key) },
		"nil key":                  func() { StreamServerInterceptor(lim, nil) },
		"typed nil limiter":        func() { UnaryServerInterceptor((*tollgate.Limiter)(nil), key) },
		"client typed nil waiter":  func() { UnaryClientInterceptor((*tollgate.Limiter)(nil), key) },
		"plan twice":               func() { UnaryServerInterceptor(lim, key, WithPlans("gold", "gold")) },
		"unknown plan":             func() { UnaryServerInterceptor(lim, key, WithPlans("platinum")) },
		"empty method plans":       func() { UnaryServerInterceptor(lim, key, WithMethodPlans(map[string][]string{emptyCall: {}})) },
		"unknown method plan":      func() { UnaryServerInterceptor(lim, key, WithMethodPlans(map[string][]string{emptyCall: {"x"}})) },
		"bad method name":          func() { UnaryServerInterceptor(lim, key, WithMethodPlans(map[string][]string{"EmptyCall": {"gold"}})) },
		"unknown metadata mode":    func() { UnaryServerInterceptor(lim, key, WithMetadata(7)) },
		"unknown message mode":     func() { StreamServerInterceptor(lim, key, WithStreamMessages(9, nil)) },
		"message plan unknown":     func() { StreamServerInterceptor(lim, key, WithStreamMessages(Reject, nil, "x")) },
		"pace without Wait":        func() { StreamServerInterceptor(&stubLimiter{}, key, WithStreamMessages(Pace, nil)) },
		"adapter with nil key":     func() { NewMiddlewareLimiter(lim, nil) },
		"client with nil waiter":   func() { UnaryClientInterceptor(nil, key) },
		"client with nil key":      func() { StreamClientInterceptor(lim, nil) },
		"client with plan twice":   func() { UnaryClientInterceptor(lim, key, WithClientPlans("gold", "gold")) },
		"client with unknown plan": func() { UnaryClientInterceptor(lim, key, WithClientPlans("x")) },
	} {
		msg := mustPanic(f)
		assert.True(t, strings.HasPrefix(msg, "grpclimit: "), "%s: panic %q", name, msg)
	}
	// A RateLimiter that does not describe its plans takes any names.
	assert.NotPanics(t, func() { UnaryServerInterceptor(&stubLimiter{}, key, WithPlans("anything")) })
}

// TestNothingPanicsPerCall feeds the interceptors calls with odd contexts
// and odd results.
func TestNothingPanicsPerCall(t *testing.T) {
	odd := []tollgate.Result{{}, {Plan: "\x00\"\\", Limit: -1, Remaining: -5, RetryAfter: -time.Second}, {Allowed: true, Limit: 1 << 62}}
	for _, res := range odd {
		for _, mode := range []MetadataMode{MetadataIETF, MetadataBoth, MetadataNone} {
			i := UnaryServerInterceptor(&stubLimiter{res: res}, ByPeerIP(), WithMetadata(mode), WithAllowedMetadata(true))
			assert.NotPanics(t, func() {
				_, _ = callUnary(context.Background(), i, "")
				_, _ = callUnary(incoming(tcp("192.0.2.1:1")), i, emptyCall)
			})
		}
	}
}

// TestDeniedStatusDescribesAWindow names a sliding window's limit by its
// window, not by a refill rate it does not have.
func TestDeniedStatusDescribesAWindow(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "api", Capacity: 1, Window: time.Minute}})
	require.NoError(t, err)
	_, err = lim.Allow(context.Background(), "k")
	require.NoError(t, err)
	res, err := lim.Allow(context.Background(), "k")
	require.NoError(t, err)
	require.False(t, res.Allowed)
	_, qf, _ := details(t, DeniedStatus(res, lim).Err())
	require.Len(t, qf.GetViolations(), 1)
	assert.Equal(t, "1 tokens in any 1m0s", qf.GetViolations()[0].GetDescription())
}

// resolverKeys notes the keys a plan resolver was given.
type resolverKeys struct {
	mu   sync.Mutex
	keys []string
}

func (k *resolverKeys) add(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !slices.Contains(k.keys, key) {
		k.keys = append(k.keys, key)
	}
}

// take returns the keys noted, sorted, and forgets them.
func (k *resolverKeys) take() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	keys := slices.Sorted(slices.Values(k.keys))
	k.keys = nil
	return keys
}

// readmeTiers is README's tier example ("Tiers: a plan per key"), with
// tiers.Of a map, on a RedisStore on miniredis, whose clock stands still:
// no bucket refills. It returns the keys the resolver is given.
func readmeTiers(t *testing.T) (*tollgate.Limiter, *resolverKeys) {
	t.Helper()
	mr := miniredis.RunT(t)
	mr.SetTime(time.Now())
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	seen := &resolverKeys{}
	tiers := map[string]string{"key-gold": "gold"}
	lim, err := tollgate.New(tollgate.NewRedisStore(c), []tollgate.Plan{{Name: "api", Capacity: 20, Rate: 10}},
		tollgate.WithPlanResolver(func(ctx context.Context, key string, p tollgate.Plan) (tollgate.Plan, error) {
			seen.add(key)
			if tiers[key] == "gold" {
				return tollgate.Plan{Name: p.Name, Capacity: 200, Rate: 100}, nil
			}
			return p, nil
		}))
	require.NoError(t, err)
	return lim, seen
}

// Behind ByMetadata, README's tier example sees the API key, so the gold
// tier applies: 50 calls pass, where the default plan admits 20; and so
// for every message of a stream.
func TestInterceptorsApplyREADMEsTiers(t *testing.T) {
	for name, key := range map[string]KeyFunc{"metadata": ByMetadata("x-api-key"), "per method": PerMethod(ByMetadata("x-api-key"))} {
		t.Run(name, func(t *testing.T) {
			lim, seen := readmeTiers(t)
			_, client := limitedServer(t, lim, key, WithPlans("api"), WithStreamMessages(Reject, nil, "api"))
			admitted := map[string]int{}
			for _, apiKey := range []string{"key-gold", "key-free"} {
				for range 50 {
					if _, err := client.EmptyCall(withKey(apiKey), &testgrpc.Empty{}); err == nil {
						admitted[apiKey]++
					}
				}
			}
			assert.Equal(t, map[string]int{"key-gold": 50, "key-free": 20}, admitted, "the gold tier, and the default plan")
			assert.Equal(t, []string{"key-free", "key-gold"}, seen.take(), "the resolver is given the API keys")

			stream, err := client.StreamingInputCall(withKey("key-gold"))
			require.NoError(t, err)
			for range 50 {
				require.NoError(t, stream.Send(&testgrpc.StreamingInputCallRequest{}))
			}
			resp, err := stream.CloseAndRecv()
			require.NoError(t, err, "every message under the gold tier")
			assert.Equal(t, int32(50), resp.GetAggregatedPayloadSize())
			assert.Equal(t, []string{"key-gold"}, seen.take())
		})
	}
}

// A client interceptor's Waiter, the Limiter, gives the resolver the
// caller's key too.
func TestClientInterceptorGivesTheResolverTheCallersKey(t *testing.T) {
	lim, seen := readmeTiers(t)
	invoke := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }
	i := UnaryClientInterceptor(lim, PerMethod(Key("key-gold")), WithClientPlans("api"))
	require.NoError(t, i(context.Background(), emptyCall, nil, nil, nil, invoke))
	assert.Equal(t, []string{emptyCall + "|key-gold"}, seen.take(), "a key of no kind is its own")

	i = UnaryClientInterceptor(lim, ByPrincipal(func(context.Context) (string, bool) { return "user-42", true }), WithClientPlans("api"))
	require.NoError(t, i(context.Background(), emptyCall, nil, nil, nil, invoke))
	assert.Equal(t, []string{"user-42"}, seen.take())
}
