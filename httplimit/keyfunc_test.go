package httplimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testProxies = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("2001:db8:ffff::/48"),
}

func TestByIP(t *testing.T) {
	fwd := IPOptions{TrustedProxies: testProxies, ProxyHeader: "forwarded"}
	tests := []struct {
		name   string
		opts   IPOptions
		remote string
		header http.Header
		want   string // "" means ErrNoKey
	}{
		// The peer alone.
		{"ipv4", IPOptions{}, "203.0.113.7:1234", nil, "ip:203.0.113.7"},
		{"ipv4 without port", IPOptions{}, "203.0.113.7", nil, "ip:203.0.113.7"},
		{"ipv6 grouped by /64", IPOptions{}, "[2001:db8:1:2:3:4:5:6]:443", nil, "ip:2001:db8:1:2::/64"},
		{"ipv6 same /64", IPOptions{}, "[2001:db8:1:2::99]:443", nil, "ip:2001:db8:1:2::/64"},
		{"ipv6 next /64", IPOptions{}, "[2001:db8:1:3::1]:443", nil, "ip:2001:db8:1:3::/64"},
		{"ipv4-mapped is ipv4", IPOptions{}, "[::ffff:203.0.113.7]:80", nil, "ip:203.0.113.7"},
		{"zone dropped", IPOptions{}, "[fe80::1%eth0]:80", nil, "ip:fe80::/64"},
		{"ipv4 by /24", IPOptions{IPv4Bits: 24}, "203.0.113.7:1", nil, "ip:203.0.113.0/24"},
		{"ipv6 by /128", IPOptions{IPv6Bits: 128}, "[2001:db8:1:2:3:4:5:6]:1", nil, "ip:2001:db8:1:2:3:4:5:6"},
		{"unix socket", IPOptions{}, "@", nil, ""},
		{"empty", IPOptions{}, "", nil, ""},

		// Proxy headers from an untrusted peer are ignored.
		{"spoofed xff, no proxies", IPOptions{}, "203.0.113.7:1", http.Header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:203.0.113.7"},
		{"spoofed xff, untrusted peer", IPOptions{TrustedProxies: testProxies}, "203.0.113.7:1", http.Header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:203.0.113.7"},
		{"spoofed forwarded, untrusted peer", fwd, "203.0.113.7:1", http.Header{"Forwarded": {"for=198.51.100.1"}}, "ip:203.0.113.7"},

		// X-Forwarded-For from a trusted peer: rightmost untrusted entry.
		{"xff", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff spoofed on the left", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"198.51.100.1, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff spoofed trusted address", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"10.9.9.9, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff chain of proxies", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7, 10.0.0.2,10.0.0.3"}}, "ip:203.0.113.7"},
		{"xff multiple lines", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"198.51.100.1", "203.0.113.7, 10.0.0.2"}}, "ip:203.0.113.7"},
		{"xff all trusted: leftmost", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"10.0.0.5, 10.0.0.6"}}, "ip:10.0.0.5"},
		{"trusted peer without header", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", nil, "ip:10.0.0.1"},
		{"xff garbage on the left ignored", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"garbage, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff garbage rightmost", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7, garbage"}}, ""},
		{"xff garbage behind a proxy", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"garbage, 10.0.0.2"}}, ""},
		{"xff half bracket", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"[2001:db8::1"}}, ""},
		{"xff empty elements", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7, ,", ""}}, "ip:203.0.113.7"},
		{"xff ipv4 with port", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7:5555"}}, "ip:203.0.113.7"},
		{"xff ipv6 with port", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"[2001:db8:1:2::1]:80"}}, "ip:2001:db8:1:2::/64"},
		{"xff ipv6 bracketed", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"[2001:db8:1:2::1]"}}, "ip:2001:db8:1:2::/64"},
		{"xff mapped", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"::ffff:203.0.113.7"}}, "ip:203.0.113.7"},
		{"ipv6 proxy", IPOptions{TrustedProxies: testProxies}, "[2001:db8:ffff::1]:443", http.Header{"X-Forwarded-For": {"2001:db8:1:2::7"}}, "ip:2001:db8:1:2::/64"},
		{"mapped peer is trusted", IPOptions{TrustedProxies: testProxies}, "[::ffff:10.0.0.1]:80", http.Header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"mapped trusted prefix", IPOptions{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")}}, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded ignored when xff is the header", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", http.Header{"Forwarded": {"for=198.51.100.1"}, "X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},

		// Forwarded from a trusted peer.
		{"xff ignored when forwarded is the header", fwd, "10.0.0.1:1", http.Header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:10.0.0.1"},
		{"forwarded", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded quoted ipv6 with port", fwd, "10.0.0.1:1", http.Header{"Forwarded": {`for="[2001:db8:cafe::17]:4711"`}}, "ip:2001:db8:cafe::/64"},
		{"forwarded quoted ipv4 with port", fwd, "10.0.0.1:1", http.Header{"Forwarded": {`for="203.0.113.7:8080"`}}, "ip:203.0.113.7"},
		{"forwarded params and case", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=198.51.100.1;proto=https, By=10.0.0.1;For=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded separators inside quotes", fwd, "10.0.0.1:1", http.Header{"Forwarded": {`for=203.0.113.7;host="x, for=198.51.100.9"`}}, "ip:203.0.113.7"},
		{"forwarded escaped quote", fwd, "10.0.0.1:1", http.Header{"Forwarded": {`for=203.0.113.7;host="a\", for=198.51.100.9"`}}, "ip:203.0.113.7"},
		{"forwarded multiple lines", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=198.51.100.1", "for=203.0.113.7, for=10.0.0.2"}}, "ip:203.0.113.7"},
		{"forwarded obfuscated on the left ignored", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=_hidden, for=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded unknown rightmost", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=203.0.113.7, for=unknown"}}, ""},
		{"forwarded element without for", fwd, "10.0.0.1:1", http.Header{"Forwarded": {"for=203.0.113.7, proto=https"}}, ""},
		{"forwarded half quoted", fwd, "10.0.0.1:1", http.Header{"Forwarded": {`for="203.0.113.7`}}, ""},
		// An open quote must not swallow what the trusted proxy appended.
		{"forwarded open quote swallowing the proxy's element", fwd, "10.0.0.1:1",
			http.Header{"Forwarded": {`for=198.51.100.66;x=", for=203.0.113.7`}}, ""},
		{"forwarded open quote on the client's own line", fwd, "10.0.0.1:1",
			http.Header{"Forwarded": {`for=198.51.100.66;x="`, `for=203.0.113.7`}}, "ip:203.0.113.7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = tt.remote
			for name, values := range tt.header {
				r.Header[name] = values
			}
			key, err := ByIPWith(tt.opts)(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				assert.NotContains(t, err.Error(), "203.0.113.7", "the error must not hold the address")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
}

func TestByIPIsByIPWith(t *testing.T) {
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "10.0.0.1:1"
	r.Header.Set("X-Forwarded-For", "203.0.113.7")

	key, err := ByIP()(r)
	require.NoError(t, err)
	assert.Equal(t, "ip:10.0.0.1", key)

	key, err = ByIP(testProxies...)(r)
	require.NoError(t, err)
	assert.Equal(t, "ip:203.0.113.7", key)
}

func TestByIPWithPanicsOnBadOptions(t *testing.T) {
	for name, o := range map[string]IPOptions{
		"ipv4 bits":     {IPv4Bits: 33},
		"ipv6 bits":     {IPv6Bits: -1},
		"proxy header":  {ProxyHeader: "X-Real-IP"},
		"invalid proxy": {TrustedProxies: []netip.Prefix{{}}},
	} {
		assert.Panics(t, func() { ByIPWith(o) }, name)
	}
}

func TestByHeader(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   string // "" means ErrNoKey
	}{
		{"present", []string{"abc"}, "header:X-Api-Key:abc"},
		{"first of several", []string{"abc", "def"}, "header:X-Api-Key:abc"},
		{"a value that spells an ip key", []string{"ip:203.0.113.7"}, "header:X-Api-Key:ip:203.0.113.7"},
		{"missing", nil, ""},
		{"empty", []string{""}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			if tt.values != nil {
				r.Header["X-Api-Key"] = tt.values
			}
			key, err := ByHeader("x-api-key")(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
	assert.Panics(t, func() { ByHeader("") })
}

type principalKey struct{}

func principalOf(ctx context.Context) (string, bool) {
	id, ok := ctx.Value(principalKey{}).(string)
	return id, ok
}

func TestByPrincipal(t *testing.T) {
	tests := []struct {
		name string
		ctx  context.Context
		want string // "" means ErrNoKey
	}{
		{"authenticated", context.WithValue(context.Background(), principalKey{}, "user-42"), "principal:user-42"},
		{"anonymous", context.Background(), ""},
		{"empty id", context.WithValue(context.Background(), principalKey{}, ""), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequestWithContext(tt.ctx, "GET", "/", nil)
			key, err := ByPrincipal(principalOf)(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
}

func TestPerRoute(t *testing.T) {
	tests := []struct {
		name    string
		pattern string
		target  string
		want    string
	}{
		{"pattern", "GET /items/{id}", "/items/7", "GET /items/{id}|header:X-Api-Key:k"},
		{"path without pattern", "", "/items/7", "/items/7|header:X-Api-Key:k"},
		{"separator in path is escaped", "", "/a%7Cheader:X-Api-Key:k", "/a%7Cheader:X-Api-Key:k|header:X-Api-Key:k"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", tt.target, nil)
			r.Pattern = tt.pattern
			r.Header.Set("X-Api-Key", "k")
			key, err := PerRoute(ByHeader("X-Api-Key"))(r)
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}

	_, err := PerRoute(ByHeader("X-Api-Key"))(httptest.NewRequest("GET", "/", nil))
	assert.ErrorIs(t, err, ErrNoKey)
}
