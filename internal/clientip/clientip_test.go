package clientip

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testProxies = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("2001:db8:ffff::/48"),
}

// header is a request's header fields, by canonical name.
type header map[string][]string

func (h header) values(name string) []string { return h[name] }

func TestKey(t *testing.T) {
	fwd := Options{TrustedProxies: testProxies, ProxyHeader: "forwarded"}
	tests := []struct {
		name   string
		opts   Options
		remote string
		header header
		want   string // "" means ErrNoKey
	}{
		// The peer alone.
		{"ipv4", Options{}, "203.0.113.7:1234", nil, "ip:203.0.113.7"},
		{"ipv4 without port", Options{}, "203.0.113.7", nil, "ip:203.0.113.7"},
		{"ipv6 grouped by /64", Options{}, "[2001:db8:1:2:3:4:5:6]:443", nil, "ip:2001:db8:1:2::/64"},
		{"ipv6 same /64", Options{}, "[2001:db8:1:2::99]:443", nil, "ip:2001:db8:1:2::/64"},
		{"ipv6 next /64", Options{}, "[2001:db8:1:3::1]:443", nil, "ip:2001:db8:1:3::/64"},
		{"ipv4-mapped is ipv4", Options{}, "[::ffff:203.0.113.7]:80", nil, "ip:203.0.113.7"},
		{"zone dropped", Options{}, "[fe80::1%eth0]:80", nil, "ip:fe80::/64"},
		{"ipv4 by /24", Options{IPv4Bits: 24}, "203.0.113.7:1", nil, "ip:203.0.113.0/24"},
		{"ipv6 by /128", Options{IPv6Bits: 128}, "[2001:db8:1:2:3:4:5:6]:1", nil, "ip:2001:db8:1:2:3:4:5:6"},
		{"unix socket", Options{}, "@", nil, ""},
		{"empty", Options{}, "", nil, ""},

		// Proxy headers from an untrusted peer are ignored.
		{"spoofed xff, no proxies", Options{}, "203.0.113.7:1", header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:203.0.113.7"},
		{"spoofed xff, untrusted peer", Options{TrustedProxies: testProxies}, "203.0.113.7:1", header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:203.0.113.7"},
		{"spoofed forwarded, untrusted peer", fwd, "203.0.113.7:1", header{"Forwarded": {"for=198.51.100.1"}}, "ip:203.0.113.7"},

		// X-Forwarded-For from a trusted peer: rightmost untrusted entry.
		{"xff", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff spoofed on the left", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"198.51.100.1, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff spoofed trusted address", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"10.9.9.9, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff chain of proxies", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7, 10.0.0.2,10.0.0.3"}}, "ip:203.0.113.7"},
		{"xff multiple lines", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"198.51.100.1", "203.0.113.7, 10.0.0.2"}}, "ip:203.0.113.7"},
		{"xff all trusted: leftmost", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"10.0.0.5, 10.0.0.6"}}, "ip:10.0.0.5"},
		{"trusted peer without header", Options{TrustedProxies: testProxies}, "10.0.0.1:1", nil, "ip:10.0.0.1"},
		{"xff garbage on the left ignored", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"garbage, 203.0.113.7"}}, "ip:203.0.113.7"},
		{"xff garbage rightmost", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7, garbage"}}, ""},
		{"xff garbage behind a proxy", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"garbage, 10.0.0.2"}}, ""},
		{"xff half bracket", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"[2001:db8::1"}}, ""},
		{"xff empty elements", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7, ,", ""}}, "ip:203.0.113.7"},
		{"xff ipv4 with port", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7:5555"}}, "ip:203.0.113.7"},
		{"xff ipv6 with port", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"[2001:db8:1:2::1]:80"}}, "ip:2001:db8:1:2::/64"},
		{"xff ipv6 bracketed", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"[2001:db8:1:2::1]"}}, "ip:2001:db8:1:2::/64"},
		{"xff mapped", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"X-Forwarded-For": {"::ffff:203.0.113.7"}}, "ip:203.0.113.7"},
		{"ipv6 proxy", Options{TrustedProxies: testProxies}, "[2001:db8:ffff::1]:443", header{"X-Forwarded-For": {"2001:db8:1:2::7"}}, "ip:2001:db8:1:2::/64"},
		{"mapped peer is trusted", Options{TrustedProxies: testProxies}, "[::ffff:10.0.0.1]:80", header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"mapped trusted prefix", Options{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")}}, "10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded ignored when xff is the header", Options{TrustedProxies: testProxies}, "10.0.0.1:1", header{"Forwarded": {"for=198.51.100.1"}, "X-Forwarded-For": {"203.0.113.7"}}, "ip:203.0.113.7"},

		// Forwarded from a trusted peer.
		{"xff ignored when forwarded is the header", fwd, "10.0.0.1:1", header{"X-Forwarded-For": {"198.51.100.1"}}, "ip:10.0.0.1"},
		{"forwarded", fwd, "10.0.0.1:1", header{"Forwarded": {"for=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded quoted ipv6 with port", fwd, "10.0.0.1:1", header{"Forwarded": {`for="[2001:db8:cafe::17]:4711"`}}, "ip:2001:db8:cafe::/64"},
		{"forwarded quoted ipv4 with port", fwd, "10.0.0.1:1", header{"Forwarded": {`for="203.0.113.7:8080"`}}, "ip:203.0.113.7"},
		{"forwarded params and case", fwd, "10.0.0.1:1", header{"Forwarded": {"for=198.51.100.1;proto=https, By=10.0.0.1;For=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded separators inside quotes", fwd, "10.0.0.1:1", header{"Forwarded": {`for=203.0.113.7;host="x, for=198.51.100.9"`}}, "ip:203.0.113.7"},
		{"forwarded escaped quote", fwd, "10.0.0.1:1", header{"Forwarded": {`for=203.0.113.7;host="a\", for=198.51.100.9"`}}, "ip:203.0.113.7"},
		{"forwarded multiple lines", fwd, "10.0.0.1:1", header{"Forwarded": {"for=198.51.100.1", "for=203.0.113.7, for=10.0.0.2"}}, "ip:203.0.113.7"},
		{"forwarded obfuscated on the left ignored", fwd, "10.0.0.1:1", header{"Forwarded": {"for=_hidden, for=203.0.113.7"}}, "ip:203.0.113.7"},
		{"forwarded unknown rightmost", fwd, "10.0.0.1:1", header{"Forwarded": {"for=203.0.113.7, for=unknown"}}, ""},
		{"forwarded element without for", fwd, "10.0.0.1:1", header{"Forwarded": {"for=203.0.113.7, proto=https"}}, ""},
		{"forwarded half quoted", fwd, "10.0.0.1:1", header{"Forwarded": {`for="203.0.113.7`}}, ""},
		// An open quote must not swallow what the trusted proxy appended.
		{"forwarded open quote swallowing the proxy's element", fwd, "10.0.0.1:1",
			header{"Forwarded": {`for=198.51.100.66;x=", for=203.0.113.7`}}, ""},
		{"forwarded open quote on the client's own line", fwd, "10.0.0.1:1",
			header{"Forwarded": {`for=198.51.100.66;x="`, `for=203.0.113.7`}}, "ip:203.0.113.7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := New(tt.opts)
			require.NoError(t, err)
			key, ok := r.Key(tt.remote, tt.header.values)
			assert.Equal(t, tt.want != "", ok)
			assert.Equal(t, tt.want, key)
		})
	}
}

func TestAddr(t *testing.T) {
	r, err := New(Options{TrustedProxies: testProxies, IPv4Bits: 24, IPv6Bits: 48})
	require.NoError(t, err)
	for _, tt := range []struct {
		remote string
		header header
		want   netip.Addr // the zero Addr means none
	}{
		{"203.0.113.7:1", nil, netip.MustParseAddr("203.0.113.7")},
		{"[2001:db8:1:2::1]:1", nil, netip.MustParseAddr("2001:db8:1:2::1")},
		{"10.0.0.1:1", header{"X-Forwarded-For": {"203.0.113.7"}}, netip.MustParseAddr("203.0.113.7")},
		{"10.0.0.1:1", header{"X-Forwarded-For": {"garbage"}}, netip.Addr{}},
		{"@", nil, netip.Addr{}},
	} {
		a, ok := r.Addr(tt.remote, tt.header.values)
		assert.Equal(t, tt.want.IsValid(), ok, "%s %v", tt.remote, tt.header)
		assert.Equal(t, tt.want, a, "%s %v: Addr ungrouped", tt.remote, tt.header)
	}
}

func TestHeaderNames(t *testing.T) {
	// Resolvers ask for canonical names, so a Header may match names in
	// any case, as http.Header.Values and metadata.MD.Get do.
	for opt, want := range map[string]string{
		"": "X-Forwarded-For", "x-forwarded-for": "X-Forwarded-For", "X-FORWARDED-FOR": "X-Forwarded-For",
		"forwarded": "Forwarded", "Forwarded": "Forwarded",
	} {
		r, err := New(Options{TrustedProxies: testProxies, ProxyHeader: opt})
		require.NoError(t, err)
		var asked []string
		r.Addr("10.0.0.1:1", func(name string) []string {
			asked = append(asked, name)
			return nil
		})
		assert.Equal(t, []string{want}, asked, "ProxyHeader %q", opt)
	}
}

func TestNewErrors(t *testing.T) {
	for _, tt := range []struct {
		opts Options
		want string
	}{
		{Options{IPv4Bits: 33}, "IPv4Bits 33 is not 1 to 32"},
		{Options{IPv4Bits: -1}, "IPv4Bits -1 is not 1 to 32"},
		{Options{IPv6Bits: 129}, "IPv6Bits 129 is not 1 to 128"},
		{Options{ProxyHeader: "X-Real-IP"}, `ProxyHeader "X-Real-IP" is neither X-Forwarded-For nor Forwarded`},
		{Options{TrustedProxies: []netip.Prefix{{}}}, "TrustedProxies holds an invalid prefix"},
	} {
		_, err := New(tt.opts)
		assert.EqualError(t, err, tt.want)
	}
}
