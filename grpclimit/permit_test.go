package grpclimit

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
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
)

var permitPlans = []tollgate.Plan{
	{Name: "one", Capacity: 1, Concurrency: true},
	{Name: "inflight", Capacity: 2, Concurrency: true},
	{Name: "hourly", Capacity: 1, Rate: tollgate.Per(1, time.Hour)},
}

// permitLimiters returns a Limiter of permitPlans on a MemoryStore and
// one on a RedisStore on miniredis, whose server it also returns.
func permitLimiters(t *testing.T) (map[string]*tollgate.Limiter, *miniredis.Miniredis) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1}) // a closed server fails at once
	t.Cleanup(func() { _ = c.Close() })
	out := map[string]*tollgate.Limiter{}
	for name, store := range map[string]tollgate.Store{"memory": tollgate.NewMemoryStore(), "miniredis": tollgate.NewRedisStore(c)} {
		l, err := tollgate.New(store, permitPlans, tollgate.WithLogger(nil))
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		out[name] = l
	}
	return out, mr
}

// heldService answers EmptyCall at once, holds UnaryCall until the test
// lets it go, holds StreamingInputCall open until the client closes it,
// and panics in CacheableUnaryCall and StreamingOutputCall.
type heldService struct {
	testgrpc.UnimplementedTestServiceServer

	entered chan struct{} // UnaryCall or StreamingInputCall began
	hungUp  chan struct{} // UnaryCall saw its context end
	letGo   chan struct{} // UnaryCall may answer
}

func (*heldService) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	return &testgrpc.Empty{}, nil
}

func (s *heldService) UnaryCall(ctx context.Context, _ *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.entered <- struct{}{}
	select {
	case <-ctx.Done():
		s.hungUp <- struct{}{}
		<-s.letGo
	case <-s.letGo:
	}
	return &testgrpc.SimpleResponse{}, nil
}

func (*heldService) CacheableUnaryCall(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	panic("boom")
}

func (*heldService) StreamingOutputCall(*testgrpc.StreamingOutputCallRequest, grpc.ServerStreamingServer[testgrpc.StreamingOutputCallResponse]) error {
	panic("boom")
}

func (s *heldService) StreamingInputCall(stream grpc.ClientStreamingServer[testgrpc.StreamingInputCallRequest, testgrpc.StreamingInputCallResponse]) error {
	s.entered <- struct{}{}
	for {
		if _, err := stream.Recv(); errors.Is(err, io.EOF) {
			return stream.SendAndClose(&testgrpc.StreamingInputCallResponse{})
		} else if err != nil {
			return err
		}
	}
}

// permitServer serves a heldService on an in-memory connection, behind
// recovery, then an interceptor that says when the calls return, then
// both server interceptors of key "k" with opts.
type permitServer struct {
	svc    *heldService
	client testgrpc.TestServiceClient
	done   chan struct{} // a call's interceptors returned, its permit released by then
	panics chan any      // what recovery recovered
}

func newPermitServer(t *testing.T, l *tollgate.Limiter, opts ...Option) *permitServer {
	t.Helper()
	s := &permitServer{
		svc:  &heldService{entered: make(chan struct{}, 8), hungUp: make(chan struct{}, 8), letGo: make(chan struct{})},
		done: make(chan struct{}, 8), panics: make(chan any, 8),
	}
	recovered := recovery.WithRecoveryHandler(func(p any) error {
		s.panics <- p
		return status.Error(codes.Internal, "panicked")
	})
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(recovery.UnaryServerInterceptor(recovered),
			func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
				defer func() { s.done <- struct{}{} }()
				return h(ctx, req)
			},
			UnaryServerInterceptor(l, Key("k"), opts...)),
		grpc.ChainStreamInterceptor(recovery.StreamServerInterceptor(recovered),
			func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
				defer func() { s.done <- struct{}{} }()
				return h(srv, ss)
			},
			StreamServerInterceptor(l, Key("k"), opts...)),
	)
	testgrpc.RegisterTestServiceServer(srv, s.svc)
	s.client = testgrpc.NewTestServiceClient(serveOn(t, srv))
	return s
}

// empty makes an EmptyCall and returns its status code.
func (s *permitServer) empty(t *testing.T) codes.Code {
	t.Helper()
	_, err := s.client.EmptyCall(context.Background(), &testgrpc.Empty{})
	wait(t, s.done, "the EmptyCall")
	return status.Code(err)
}

// wait receives from c, or fails the test after a generous while.
func wait[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(10 * time.Second):
		require.FailNow(t, "timed out waiting: "+what)
		panic("unreachable")
	}
}

// A handler that panics, of a call or a stream, releases its permit: the
// panic goes up through the interceptor to recovery as it came, and the
// next call gets the one permit.
func TestPermitReleasedWhenTheHandlerPanics(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("one"))
			_, err := s.client.CacheableUnaryCall(context.Background(), &testgrpc.SimpleRequest{})
			assert.Equal(t, codes.Internal, status.Code(err))
			assert.Equal(t, "boom", wait(t, s.panics, "the unary panic"), "the panic goes on up")
			wait(t, s.done, "the panicking call")
			assert.Equal(t, codes.OK, s.empty(t), "the unary call's permit came back")

			stream, err := s.client.StreamingOutputCall(context.Background(), &testgrpc.StreamingOutputCallRequest{})
			require.NoError(t, err)
			_, err = stream.Recv()
			assert.Equal(t, codes.Internal, status.Code(err))
			assert.Equal(t, "boom", wait(t, s.panics, "the stream's panic"))
			wait(t, s.done, "the panicking stream")
			assert.Equal(t, codes.OK, s.empty(t), "the stream's permit came back")
			assert.Equal(t, uint64(4), l.Stats().Permits.Released, "2 panics, 2 calls")
		})
	}
}

// A client that cancels a call mid-handler does not end the handler: the
// permit is held until the handler returns, and released then, though
// the call's context has ended. A cancelled stream releases its permit
// when its handler returns.
func TestPermitReleasedWhenTheClientCancels(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("one"))
			ctx, cancel := context.WithCancel(context.Background())
			failed := make(chan error, 1)
			go func() {
				_, err := s.client.UnaryCall(ctx, &testgrpc.SimpleRequest{})
				failed <- err
			}()
			wait(t, s.svc.entered, "the call to reach the handler")
			cancel()
			assert.Equal(t, codes.Canceled, status.Code(wait(t, failed, "the client to give up")))
			wait(t, s.svc.hungUp, "the handler to see the cancellation")
			assert.Equal(t, codes.ResourceExhausted, s.empty(t), "held while the handler runs")
			s.svc.letGo <- struct{}{}
			wait(t, s.done, "the handler to return")
			assert.Equal(t, codes.OK, s.empty(t), "the permit came back")

			ctx, cancel = context.WithCancel(context.Background())
			_, err := s.client.StreamingInputCall(ctx)
			require.NoError(t, err)
			wait(t, s.svc.entered, "the stream to reach the handler")
			cancel()
			wait(t, s.done, "the stream's handler to return")
			assert.Equal(t, codes.OK, s.empty(t), "the stream's permit came back")
			assert.Equal(t, uint64(4), l.Stats().Permits.Released)
		})
	}
}

// A stream holds its permit until it ends, not just while it opens.
func TestPermitHeldForTheWholeStream(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("one"))
			stream, err := s.client.StreamingInputCall(context.Background())
			require.NoError(t, err)
			wait(t, s.svc.entered, "the stream to reach the handler")
			require.NoError(t, stream.Send(&testgrpc.StreamingInputCallRequest{}))
			assert.Equal(t, codes.ResourceExhausted, s.empty(t), "held while the stream is open")
			_, err = stream.CloseAndRecv()
			require.NoError(t, err)
			wait(t, s.done, "the stream to end")
			assert.Equal(t, codes.OK, s.empty(t), "the stream's permit came back")
		})
	}
}

// With 2 calls in flight of a capacity of 2, the third ends with
// ResourceExhausted and no time to try again; the trailer says none is
// free.
func TestPermitCapacityRefusesTheNext(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("inflight"), WithMetadata(MetadataBoth))
			for range 2 {
				go func() { _, _ = s.client.UnaryCall(context.Background(), &testgrpc.SimpleRequest{}) }()
				wait(t, s.svc.entered, "a call to reach the handler")
			}
			var trailer metadata.MD
			_, err := s.client.EmptyCall(context.Background(), &testgrpc.Empty{}, grpc.Trailer(&trailer))
			wait(t, s.done, "the refused call")
			st := status.Convert(err)
			assert.Equal(t, codes.ResourceExhausted, st.Code())
			assert.Equal(t, "no free permit (plan inflight)", st.Message())
			var kinds []string
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.RetryInfo:
					kinds = append(kinds, "RetryInfo")
				case *errdetails.QuotaFailure:
					kinds = append(kinds, "QuotaFailure")
					assert.Equal(t, "2 permits held at once", d.Violations[0].Description)
				case *errdetails.ErrorInfo:
					kinds = append(kinds, "ErrorInfo")
				}
			}
			assert.Equal(t, []string{"QuotaFailure", "ErrorInfo"}, kinds, "no RetryInfo: no schedule")
			sent := metadata.MD{}
			for _, name := range mdNames {
				if v := trailer.Get(name); v != nil {
					sent[name] = v
				}
			}
			assert.Equal(t, metadata.MD{
				"ratelimit-policy": {`"inflight";q=2`}, "ratelimit": {`"inflight";r=0`},
				"x-ratelimit-limit": {"2"}, "x-ratelimit-remaining": {"0"},
			}, sent, "no reset, retry-after or grpc-retry-pushback-ms")

			for range 2 {
				s.svc.letGo <- struct{}{}
				wait(t, s.done, "a held call")
			}
			assert.Equal(t, codes.OK, s.empty(t))
		})
	}
}

// A rate plan chained with a concurrency plan that refuses has a
// schedule: RetryInfo, retry-after and the pushback are kept.
func TestPermitChainedRatePlanKeepsRetryInfo(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("inflight", "hourly"))
			require.Equal(t, codes.OK, s.empty(t))
			var trailer metadata.MD
			_, err := s.client.EmptyCall(context.Background(), &testgrpc.Empty{}, grpc.Trailer(&trailer))
			wait(t, s.done, "the refused call")
			st := status.Convert(err)
			assert.Equal(t, "rate limited (plan hourly)", st.Message())
			require.NotEmpty(t, st.Details())
			assert.IsType(t, &errdetails.RetryInfo{}, st.Details()[0])
			assert.Equal(t, []string{"3600"}, trailer.Get("retry-after"))
			assert.NotEmpty(t, trailer.Get("grpc-retry-pushback-ms"))
		})
	}
}

// A release that fails does not change the call's status; the handler
// hears of it, by default as a log line without the key.
func TestPermitReleaseErrors(t *testing.T) {
	var logged bytes.Buffer
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	type heard struct {
		method string
		err    error
	}
	var got []heard
	for name, opts := range map[string][]Option{
		"default": {WithPlans("one")},
		"handler": {WithPlans("one"), WithReleaseErrorHandler(func(_ context.Context, method string, err error) {
			got = append(got, heard{method, err})
		})},
	} {
		t.Run(name, func(t *testing.T) {
			lims, mr := permitLimiters(t)
			s := newPermitServer(t, lims["miniredis"], opts...)
			answered := make(chan error, 1)
			go func() {
				_, err := s.client.UnaryCall(context.Background(), &testgrpc.SimpleRequest{})
				answered <- err
			}()
			wait(t, s.svc.entered, "the call to reach the handler")
			mr.Close()
			s.svc.letGo <- struct{}{}
			assert.NoError(t, wait(t, answered, "the answer"))
			wait(t, s.done, "the handler to return")
		})
	}
	require.Len(t, got, 1)
	assert.Equal(t, unaryCall, got[0].method)
	assert.ErrorIs(t, got[0].err, tollgate.ErrStoreUnavailable)
	assert.Contains(t, logged.String(), "grpclimit: releasing a permit failed")
	assert.Contains(t, logged.String(), unaryCall)
	assert.Equal(t, 1, bytes.Count(logged.Bytes(), []byte("releasing a permit failed")), "the handler replaces the log")
}

// planOnly describes plans but acquires no permits.
type planOnly struct{ stubLimiter }

func (*planOnly) Plan(name string) (tollgate.Plan, bool) {
	return tollgate.Plan{Name: name, Capacity: 2, Concurrency: true}, true
}

func TestPermitWiringMistakesPanic(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), permitPlans)
	require.NoError(t, err)
	for _, tt := range []struct {
		msg string
		f   func()
	}{
		{"grpclimit: UnaryServerInterceptor: a concurrency plan needs a RateLimiter that is an Acquirer",
			func() { UnaryServerInterceptor(&planOnly{}, Key("k"), WithPlans("one")) }},
		{"grpclimit: StreamServerInterceptor: WithMethodPlans: /s.S/M: a concurrency plan needs a RateLimiter that is an Acquirer",
			func() {
				StreamServerInterceptor(&planOnly{}, Key("k"), WithMethodPlans(map[string][]string{"/s.S/M": {"one"}}))
			}},
		{"grpclimit: StreamServerInterceptor: WithStreamMessages: a message holds no permit: name its plans, and no concurrency plan",
			func() { StreamServerInterceptor(l, Key("k"), WithPlans("one"), WithStreamMessages(Reject, nil)) }},
		{"grpclimit: StreamServerInterceptor: WithStreamMessages: a message holds no permit: name its plans, and no concurrency plan",
			func() {
				StreamServerInterceptor(l, Key("k"), WithPlans("hourly"), WithStreamMessages(Reject, nil, "hourly", "one"))
			}},
		{"grpclimit: NewMiddlewareLimiter: a concurrency plan's permit needs the interceptors of this package, which release it",
			func() {
				NewMiddlewareLimiter(l, Key("k"), WithPlans("hourly"), WithMethodPlans(map[string][]string{"/s.S/": {"inflight"}}))
			}},
	} {
		assert.PanicsWithValue(t, tt.msg, tt.f)
	}
	assert.NotPanics(t, func() {
		StreamServerInterceptor(l, Key("k"), WithPlans("one", "hourly"), WithStreamMessages(Reject, nil, "hourly"))
	})
}

// TestPermitDefaultPlanPanics: without WithPlans, a call, or one of a
// method WithMethodPlans does not name, takes from the Limiter's default
// plan with AllowN, which a concurrency plan refuses. Before, the
// interceptors took it and every such call ended codes.Internal.
func TestPermitDefaultPlanPanics(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), permitPlans) // "one" first
	require.NoError(t, err)
	_, err = l.Allow(context.Background(), "k")
	require.ErrorIs(t, err, tollgate.ErrInvalidPlan, "what every call would get")
	const msg = `: the default plan "one" is a concurrency plan: name it in WithPlans`
	methods := WithMethodPlans(map[string][]string{"/s.S/": {"hourly"}})
	assert.PanicsWithValue(t, "grpclimit: UnaryServerInterceptor"+msg, func() { UnaryServerInterceptor(l, Key("k")) })
	assert.PanicsWithValue(t, "grpclimit: StreamServerInterceptor"+msg, func() { StreamServerInterceptor(l, Key("k"), methods) })
	assert.PanicsWithValue(t, "grpclimit: NewMiddlewareLimiter"+msg, func() { NewMiddlewareLimiter(l, Key("k"), WithPlans()) })
	assert.NotPanics(t, func() { UnaryServerInterceptor(l, Key("k"), WithPlans("one"), methods) })
	assert.NotPanics(t, func() { UnaryServerInterceptor(&planOnly{}, Key("k")) }, "a RateLimiter that tells no default")
}
