package grpclimit

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/test/bufconn"

	"github.com/tollgate-go/tollgate"
)

// Full method names of the test service.
const (
	emptyCall      = "/grpc.testing.TestService/EmptyCall"
	unaryCall      = "/grpc.testing.TestService/UnaryCall"
	streamingInput = "/grpc.testing.TestService/StreamingInputCall"
)

// testService counts what its handlers see.
type testService struct {
	testgrpc.UnimplementedTestServiceServer

	mu       sync.Mutex
	calls    int         // unary calls that reached a handler
	received []time.Time // when StreamingInputCall's handler got each message
}

func (s *testService) EmptyCall(context.Context, *testgrpc.Empty) (*testgrpc.Empty, error) {
	s.mu.Lock()
	s.calls++
	s.mu.Unlock()
	return &testgrpc.Empty{}, nil
}

func (s *testService) UnaryCall(context.Context, *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	s.mu.Lock()
	s.calls++
	s.mu.Unlock()
	return &testgrpc.SimpleResponse{}, nil
}

// StreamingInputCall receives until the client closes, and answers the
// number of messages it received in AggregatedPayloadSize.
func (s *testService) StreamingInputCall(stream grpc.ClientStreamingServer[testgrpc.StreamingInputCallRequest, testgrpc.StreamingInputCallResponse]) error {
	n := 0
	for {
		_, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return stream.SendAndClose(&testgrpc.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
		}
		if err != nil {
			return err
		}
		n++
		s.mu.Lock()
		s.received = append(s.received, time.Now())
		s.mu.Unlock()
	}
}

func (s *testService) handled() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

func (s *testService) receivedAt() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Time(nil), s.received...)
}

// serve starts the test service on an in-memory connection with the
// server options given, and returns the service and a client connected
// to it with the dial options given. Both stop when the test ends.
func serve(t testing.TB, sopts []grpc.ServerOption, dopts ...grpc.DialOption) (*testService, *grpc.ClientConn) {
	t.Helper()
	srv := grpc.NewServer(sopts...)
	svc := &testService{}
	testgrpc.RegisterTestServiceServer(srv, svc)
	return svc, serveOn(t, srv, dopts...)
}

// serveOn starts srv on an in-memory connection, and returns a client
// connected to it with the dial options given. Both stop when the test
// ends.
func serveOn(t testing.TB, srv *grpc.Server, dopts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	dopts = append([]grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
	}, dopts...)
	conn, err := grpc.NewClient("passthrough:///bufconn", dopts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		<-done
	})
	return conn
}

// limitedServer serves the test service behind both server interceptors.
func limitedServer(t testing.TB, l tollgate.RateLimiter, key KeyFunc, opts ...Option) (*testService, testgrpc.TestServiceClient) {
	t.Helper()
	svc, conn := serve(t, []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(UnaryServerInterceptor(l, key, opts...)),
		grpc.ChainStreamInterceptor(StreamServerInterceptor(l, key, opts...)),
	})
	return svc, testgrpc.NewTestServiceClient(conn)
}

func newLimiter(t testing.TB, store tollgate.Store, opts ...tollgate.Option) *tollgate.Limiter {
	t.Helper()
	lim, err := tollgate.New(store, []tollgate.Plan{
		{Name: "gold", Capacity: 2, Rate: 1},
		{Name: "daily", Capacity: 1000, Rate: tollgate.Per(1000, 24*time.Hour)},
		{Name: "slow", Capacity: 1, Rate: tollgate.Per(1, time.Hour)},
		{Name: "msgs", Capacity: 2, Rate: 20},
	}, opts...)
	require.NoError(t, err)
	return lim
}

// stubLimiter answers every decision with res and err, and records what
// it was asked.
type stubLimiter struct {
	res tollgate.Result
	err error

	mu    sync.Mutex
	keys  []string
	costs []int64
	plans [][]string
}

func (s *stubLimiter) Allow(ctx context.Context, key string, plans ...string) (tollgate.Result, error) {
	return s.AllowN(ctx, key, 1, plans...)
}

func (s *stubLimiter) AllowN(_ context.Context, key string, cost int64, plans ...string) (tollgate.Result, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys = append(s.keys, key)
	s.costs = append(s.costs, cost)
	s.plans = append(s.plans, plans)
	return s.res, s.err
}

// callUnary runs a unary server interceptor on a call of fullMethod from
// ctx, and reports whether the handler ran.
func callUnary(ctx context.Context, i grpc.UnaryServerInterceptor, fullMethod string) (bool, error) {
	ran := false
	_, err := i(ctx, nil, &grpc.UnaryServerInfo{FullMethod: fullMethod}, func(context.Context, any) (any, error) {
		ran = true
		return nil, nil
	})
	return ran, err
}
