package grpclimit

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/tollgate-go/tollgate"
)

// benchStream is the server side of a call as the interceptor sees it
// through its context: it keeps header metadata as grpc-go's transport
// stream does (a lock and metadata.Join), so that the benchmark charges
// the interceptor what setting its header costs in a real server.
type benchStream struct {
	mu      sync.Mutex
	header  metadata.MD
	trailer metadata.MD
}

func (s *benchStream) Method() string { return emptyCall }

func (s *benchStream) SetHeader(md metadata.MD) error {
	if md.Len() == 0 {
		return nil
	}
	s.mu.Lock()
	s.header = metadata.Join(s.header, md)
	s.mu.Unlock()
	return nil
}

func (s *benchStream) SendHeader(md metadata.MD) error { return s.SetHeader(md) }

func (s *benchStream) SetTrailer(md metadata.MD) error {
	s.mu.Lock()
	s.trailer = metadata.Join(s.trailer, md)
	s.mu.Unlock()
	return nil
}

// BenchmarkUnary measures a unary server interceptor's overhead over the
// bare decision it makes: "allow" is Limiter.Allow on a MemoryStore with
// the key at hand; the others run the interceptor, which makes the same
// decision, on a call whose handler does nothing. Run both in one binary
// and compare with benchstat (see README).
func BenchmarkUnary(b *testing.B) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e9}})
	require.NoError(b, err)
	stream := &benchStream{}
	ctx := grpc.NewContextWithServerTransportStream(
		metadata.NewIncomingContext(context.Background(), metadata.Pairs("x-api-key", "k")), stream)
	ctx = peer.NewContext(ctx, &peer.Peer{Addr: tcp("203.0.113.7:50123")})
	info := &grpc.UnaryServerInfo{FullMethod: emptyCall}
	handler := func(context.Context, any) (any, error) { return nil, nil }
	const key = "md:x-api-key:k"

	b.Run("via=allow", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			res, err := lim.Allow(ctx, key, "p")
			if err != nil || !res.Allowed {
				b.Fatal(res, err)
			}
		}
	})
	for _, bc := range []struct {
		name string
		i    grpc.UnaryServerInterceptor
	}{
		{"via=interceptor", UnaryServerInterceptor(lim, Key(key), WithPlans("p"))},
		{"via=interceptor-by-metadata", UnaryServerInterceptor(lim, ByMetadata("x-api-key"), WithPlans("p"))},
		{"via=interceptor-by-peer-ip", UnaryServerInterceptor(lim, ByPeerIP(), WithPlans("p"))},
		{"via=interceptor-allowed-metadata", UnaryServerInterceptor(lim, Key(key), WithPlans("p"), WithAllowedMetadata(true))},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				stream.header = nil // a new call's stream
				if _, err := bc.i(ctx, nil, info, handler); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUnaryCall measures whole calls over an in-memory connection,
// without and with the interceptor: what the limit adds to a call that
// crosses grpc-go's transport.
func BenchmarkUnaryCall(b *testing.B) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e9}})
	require.NoError(b, err)
	for _, bc := range []struct {
		name string
		opts []grpc.ServerOption
	}{
		{"via=bare", nil},
		{"via=limited", []grpc.ServerOption{grpc.ChainUnaryInterceptor(UnaryServerInterceptor(lim, ByMetadata("x-api-key"), WithPlans("p")))}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			_, conn := serve(b, bc.opts)
			client := testgrpc.NewTestServiceClient(conn)
			ctx := withKey("k")
			b.ReportAllocs()
			for b.Loop() {
				if _, err := client.EmptyCall(ctx, &testgrpc.Empty{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
