package grpclimit

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
)

const method = "/grpc.testing.TestService/UnaryCall"

// incoming returns a server call's context from the peer addr (nil for
// none) and the metadata pairs kv.
func incoming(addr net.Addr, kv ...string) context.Context {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(kv...))
	if addr != nil {
		ctx = peer.NewContext(ctx, &peer.Peer{Addr: addr})
	}
	return ctx
}

func tcp(s string) net.Addr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }

type unixAddr struct{}

func (unixAddr) Network() string { return "unix" }
func (unixAddr) String() string  { return "@" }

func TestByPeerIP(t *testing.T) {
	key := ByPeerIPWith(IPOptions{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	tests := []struct {
		name string
		ctx  context.Context
		want string // "" for ErrNoKey
	}{
		{"peer", incoming(tcp("203.0.113.7:50123")), "ip:203.0.113.7"},
		{"untrusted peer: x-forwarded-for ignored", incoming(tcp("203.0.113.7:50123"), "x-forwarded-for", "198.51.100.1"), "ip:203.0.113.7"},
		{"trusted proxy: rightmost untrusted", incoming(tcp("10.0.0.2:443"), "x-forwarded-for", "198.51.100.1, 203.0.113.9"), "ip:203.0.113.9"},
		{"IPv6 by /64", incoming(tcp("[2001:db8:1:2:3:4:5:6]:443")), "ip:2001:db8:1:2::/64"},
		{"IPv6 through a proxy", incoming(tcp("10.0.0.2:443"), "x-forwarded-for", "2001:db8:1:2:3:4:5:6, 10.0.0.3"), "ip:2001:db8:1:2::/64"},
		{"IPv4-mapped", incoming(tcp("[::ffff:203.0.113.7]:1")), "ip:203.0.113.7"},
		{"proxy entry not an address", incoming(tcp("10.0.0.2:443"), "x-forwarded-for", "203.0.113.9, garbage"), ""},
		{"no peer", incoming(nil), ""},
		{"unix socket", incoming(unixAddr{}), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := key(tt.ctx, method)
			if tt.want == "" {
				assert.ErrorIs(t, err, ErrNoKey)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, k)
		})
	}
}

func TestByPeerIPForwarded(t *testing.T) {
	key := ByPeerIPWith(IPOptions{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, ProxyHeader: "Forwarded"})
	k, err := key(incoming(tcp("10.0.0.2:443"), "forwarded", `for=198.51.100.1, for="[2001:db8:cafe::17]:4711"`), method)
	require.NoError(t, err)
	assert.Equal(t, "ip:2001:db8:cafe::/64", k)
}

func TestByMetadata(t *testing.T) {
	key := ByMetadata("X-API-Key")
	k, err := key(incoming(nil, "x-api-key", "abc", "x-api-key", "second"), method)
	require.NoError(t, err)
	assert.Equal(t, "md:x-api-key:abc", k)

	for _, ctx := range []context.Context{incoming(nil), incoming(nil, "x-api-key", ""), context.Background()} {
		_, err = key(ctx, method)
		assert.ErrorIs(t, err, ErrNoKey)
	}
}

func TestByPrincipal(t *testing.T) {
	type ctxKey struct{}
	key := ByPrincipal(func(ctx context.Context) (string, bool) {
		id, ok := ctx.Value(ctxKey{}).(string)
		return id, ok
	})
	k, err := key(context.WithValue(context.Background(), ctxKey{}, "user-7"), method)
	require.NoError(t, err)
	assert.Equal(t, "principal:user-7", k)
	_, err = key(context.Background(), method)
	assert.ErrorIs(t, err, ErrNoKey)
	_, err = key(context.WithValue(context.Background(), ctxKey{}, ""), method)
	assert.ErrorIs(t, err, ErrNoKey)
}

func TestPerMethod(t *testing.T) {
	key := PerMethod(ByMetadata("tenant"))
	k, err := key(incoming(nil, "tenant", "acme"), method)
	require.NoError(t, err)
	assert.Equal(t, method+"|md:tenant:acme", k)
	_, err = key(incoming(nil), method)
	assert.ErrorIs(t, err, ErrNoKey)
}

func TestKeyFuncErrorsHoldNoKey(t *testing.T) {
	const secret = "s3cr3t-value"
	for _, key := range []KeyFunc{ByMetadata("x-api-key"), ByPeerIP(netip.MustParsePrefix("10.0.0.0/8"))} {
		_, err := key(incoming(tcp("10.0.0.1:1"), "x-forwarded-for", secret), method)
		require.Error(t, err)
		assert.NotContains(t, err.Error(), secret)
	}
}

func TestKeyFuncsPanicOnWiringMistakes(t *testing.T) {
	for name, f := range map[string]func(){
		"empty Key":               func() { Key("") },
		"empty metadata name":     func() { ByMetadata("") },
		"binary metadata":         func() { ByMetadata("token-bin") },
		"binary metadata, upper":  func() { ByMetadata("Token-Bin") },
		"bad metadata name":       func() { ByMetadata("x api key") },
		"pseudo-header":           func() { ByMetadata(":authority") },
		"nil principal":           func() { ByPrincipal(nil) },
		"nil PerMethod":           func() { PerMethod(nil) },
		"IPv4Bits out of range":   func() { ByPeerIPWith(IPOptions{IPv4Bits: 33}) },
		"unknown proxy header":    func() { ByPeerIPWith(IPOptions{ProxyHeader: "X-Real-IP"}) },
		"invalid trusted network": func() { ByPeerIP(netip.Prefix{}) },
	} {
		assert.Panics(t, f, name)
	}
	assert.NotPanics(t, func() { ByMetadata("binary-token") })
	assert.True(t, strings.HasPrefix(mustPanic(func() { ByMetadata("a-bin") }), "grpclimit: ByMetadata:"))
}

func mustPanic(f func()) (msg string) {
	defer func() { msg, _ = recover().(string) }()
	f()
	return ""
}
