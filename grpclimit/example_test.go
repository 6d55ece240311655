package grpclimit_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/grpclimit"
)

// A gRPC service (grpc-go's health service) with a limit per client,
// kept in Redis (here an embedded miniredis): each client, named by its
// x-client-id metadata, may make 2 calls at once and 1 a second after.
// Then a client that paces itself below that limit, and is never denied.
func Example() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	lim, err := tollgate.New(tollgate.NewRedisStore(rdb), []tollgate.Plan{
		{Name: "per-client", Capacity: 2, Rate: 1},
	})
	if err != nil {
		panic(err)
	}

	// The server: one interceptor per kind of call.
	key := grpclimit.ByMetadata("x-client-id")
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, key)),
		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(lim, key)),
	)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	dial := grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) })

	// A client that does not pace itself: the third call is denied.
	conn, err := grpc.NewClient("passthrough:///health", dial, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-client-id", "alice")
	for i := 1; i <= 3; i++ {
		var trailer metadata.MD
		_, err := health.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
		if err == nil {
			fmt.Printf("call %d: OK\n", i)
			continue
		}
		st := status.Convert(err)
		fmt.Printf("call %d: %s %q\n", i, st.Code(), st.Message())
		for _, d := range st.Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay().AsDuration() > 0 {
				fmt.Println("  RetryInfo: retry later, within a second")
			}
		}
		for _, name := range []string{"ratelimit-policy", "ratelimit", "retry-after"} {
			fmt.Printf("  %s: %s\n", name, trailer.Get(name)[0])
		}
	}

	// A client that paces itself, with a local limit below the server's
	// (0.8 calls a second): it waits rather than being denied.
	pace, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "upstream", Capacity: 2, Rate: 0.8},
	})
	if err != nil {
		panic(err)
	}
	paced, err := grpc.NewClient("passthrough:///health", dial, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(pace, grpclimit.Key("upstream:health"))))
	if err != nil {
		panic(err)
	}
	defer paced.Close()
	health = healthpb.NewHealthClient(paced)
	ctx = metadata.AppendToOutgoingContext(context.Background(), "x-client-id", "bob")
	ok := 0
	for range 3 {
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if _, err := health.Check(ctx, &healthpb.HealthCheckRequest{}); err == nil {
			ok++
		}
		cancel()
	}
	fmt.Printf("paced client: %d of 3 calls OK\n", ok)
	// Output:
	// call 1: OK
	// call 2: OK
	// call 3: ResourceExhausted "rate limited (plan per-client)"
	//   RetryInfo: retry later, within a second
	//   ratelimit-policy: "per-client";q=2;w=2
	//   ratelimit: "per-client";r=0;t=1
	//   retry-after: 1
	// paced client: 3 of 3 calls OK
}

func ExampleByPeerIPWith() {
	key := grpclimit.ByPeerIPWith(grpclimit.IPOptions{
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
	})
	for _, c := range []struct{ peer, xff string }{
		{"203.0.113.7:50123", ""},
		{"203.0.113.7:50123", "198.51.100.1"},              // untrusted peer: metadata ignored
		{"10.0.0.2:443", "198.51.100.1, 203.0.113.9"},      // rightmost untrusted address
		{"10.0.0.2:443", "2001:db8:1:2:3:4:5:6, 10.0.0.3"}, // IPv6 by /64
	} {
		// grpc-go puts the peer and the incoming metadata in a call's
		// context; a test builds them.
		ctx := peer.NewContext(context.Background(), &peer.Peer{Addr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(c.peer))})
		if c.xff != "" {
			ctx = metadata.NewIncomingContext(ctx, metadata.Pairs("x-forwarded-for", c.xff))
		}
		k, err := key(ctx, "/shop.Cart/Add")
		fmt.Printf("%q %v\n", k, err)
	}
	// Output:
	// "ip:203.0.113.7" <nil>
	// "ip:203.0.113.7" <nil>
	// "ip:203.0.113.9" <nil>
	// "ip:2001:db8:1:2::/64" <nil>
}
