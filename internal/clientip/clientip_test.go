package clientip

import (
	"net/netip"
	"strings"
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
		want   string // "" means no key
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

			// KeyOf, given the peer as an address, agrees.
			if ap, err := netip.ParseAddrPort(tt.remote); err == nil {
				key, ok = r.KeyOf(ap.Addr(), tt.header.values)
				assert.Equal(t, tt.want != "", ok, "KeyOf")
				assert.Equal(t, tt.want, key, "KeyOf")
			}
		})
	}
}

func TestKeyOf(t *testing.T) {
	r, err := New(Options{TrustedProxies: testProxies})
	require.NoError(t, err)
	for _, tt := range []struct {
		peer netip.Addr
		want string
	}{
		{netip.MustParseAddr("::ffff:203.0.113.7"), "ip:203.0.113.7"},
		{netip.MustParseAddr("fe80::1%eth0"), "ip:fe80::/64"},
		{netip.MustParseAddr("::ffff:10.0.0.1"), "ip:198.51.100.1"}, // a mapped proxy is trusted
		{netip.Addr{}, ""},
	} {
		key, ok := r.KeyOf(tt.peer, header{"X-Forwarded-For": {"198.51.100.1"}}.values)
		assert.Equal(t, tt.want != "", ok, "%v", tt.peer)
		assert.Equal(t, tt.want, key, "%v", tt.peer)
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

// spoofed returns n bytes or more of what a client may send in the proxy
// header ahead of what the proxies append: garbage, and addresses in the
// trusted networks, as XFF entries or as Forwarded elements.
func spoofed(n int, isForwarded bool) string {
	entries := []string{"garbage", "10.9.9.9", "beef", "[2001:db8:ffff::9]:1"}
	if isForwarded {
		entries = []string{`for=garbage;proto="a, b"`, "for=10.9.9.9", "for=_hidden", `for="[2001:db8:ffff::9]:1"`}
	}
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		b.WriteString(entries[i%len(entries)])
		b.WriteString(", ")
	}
	return b.String()
}

func TestAddrAllocations(t *testing.T) {
	// Clients choose the proxy header: a long one costs no allocation,
	// whatever it holds left of the address the proxy appended, or if
	// that address is garbage. Only text that looks like an address but
	// is none reaches netip, which allocates its error: once, as that
	// entry ends the walk.
	xff, err := New(Options{TrustedProxies: testProxies})
	require.NoError(t, err)
	fwd, err := New(Options{TrustedProxies: testProxies, ProxyHeader: "Forwarded"})
	require.NoError(t, err)
	lines := make([]string, 1000)
	for i := range lines {
		lines[i] = "garbage"
	}
	lines[len(lines)-1] = "203.0.113.7"
	tests := []struct {
		name   string
		r      *Resolver
		h      header
		want   string // "" means no address
		allocs float64
	}{
		{"xff", xff, header{"X-Forwarded-For": {spoofed(64<<10, false) + "203.0.113.7"}}, "203.0.113.7", 0},
		{"xff ipv6", xff, header{"X-Forwarded-For": {spoofed(64<<10, false) + "[2001:db8::1]:80, 10.0.0.2"}}, "2001:db8::1", 0},
		{"xff garbage rightmost", xff, header{"X-Forwarded-For": {spoofed(64<<10, false) + "junk"}}, "", 0},
		{"xff almost an address rightmost", xff, header{"X-Forwarded-For": {spoofed(64<<10, false) + "[::1"}}, "", 1},
		{"xff in many lines", xff, header{"X-Forwarded-For": lines}, "203.0.113.7", 0},
		{"xff all trusted", xff, header{"X-Forwarded-For": {strings.Repeat("10.1.2.3, ", 6<<10) + "10.0.0.2"}}, "10.1.2.3", 0},
		{"forwarded", fwd, header{"Forwarded": {spoofed(64<<10, true) + "for=203.0.113.7"}}, "203.0.113.7", 0},
		{"forwarded quoted ipv6", fwd, header{"Forwarded": {spoofed(64<<10, true) + `for="[2001:db8::1]:80";proto=https`}}, "2001:db8::1", 0},
		{"forwarded garbage rightmost", fwd, header{"Forwarded": {spoofed(64<<10, true) + "for=unknown"}}, "", 0},
		{"forwarded open quote", fwd, header{"Forwarded": {`x="` + spoofed(64<<10, true) + "for=203.0.113.7"}}, "", 0},
		{"forwarded all trusted", fwd, header{"Forwarded": {strings.Repeat("for=10.1.2.3, ", 4<<10) + "for=10.0.0.2"}}, "10.1.2.3", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, ok := tt.r.Addr("10.0.0.1:1", tt.h.values)
			if tt.want == "" {
				assert.False(t, ok)
			} else {
				assert.Equal(t, netip.MustParseAddr(tt.want), a)
			}
			allocs := testing.AllocsPerRun(20, func() { tt.r.Addr("10.0.0.1:1", tt.h.values) })
			assert.Equal(t, tt.allocs, allocs)
		})
	}
}

func TestForwardedBeyondRememberedCommas(t *testing.T) {
	// More trusted elements at the end of a line than commas remembers:
	// the rest of the line is walked from the left, with the same result.
	fwd, err := New(Options{TrustedProxies: testProxies, ProxyHeader: "Forwarded"})
	require.NoError(t, err)
	trusted := strings.Repeat(", for=10.1.2.3", 40)
	for _, tt := range []struct {
		name, line, want string // want "" means no address
	}{
		{"untrusted further left", "for=198.51.100.1, for=203.0.113.7" + trusted, "203.0.113.7"},
		{"garbage further left", "for=203.0.113.7, for=unknown" + trusted, ""},
		{"all trusted: on to the line above", "for=10.0.0.5" + trusted, "198.51.100.9"},
		{"empty elements", ", ,for=10.0.0.5, ," + trusted, "198.51.100.9"},
		{"quoted commas", `for=203.0.113.7;x=", for=10.0.0.9"` + trusted, "203.0.113.7"},
	} {
		h := header{"Forwarded": {"for=198.51.100.9", tt.line}}
		a, ok := fwd.Addr("10.0.0.1:1", h.values)
		ref, refOK := referenceAddr(fwd, "10.0.0.1:1", h.values)
		assert.Equal(t, tt.want != "", ok, tt.name)
		assert.Equal(t, ref, a, "%s: as the reference", tt.name)
		assert.Equal(t, refOK, ok, "%s: as the reference", tt.name)
		if tt.want != "" {
			assert.Equal(t, netip.MustParseAddr(tt.want), a, tt.name)
		}
	}
}

// referenceAddr is Addr as it was before it walked from the right: it
// parses every hop of every line into a list, then walks the list. The
// fuzz tests hold Addr to it.
func referenceAddr(r *Resolver, peer string, header Header) (netip.Addr, bool) {
	addr, ok := referenceParsePeer(peer)
	if !ok || !r.isTrusted(addr) {
		return addr, ok
	}
	var hops []netip.Addr
	for _, v := range header(r.header) {
		if r.header == forwarded {
			hops = referenceForwardedFor(hops, v)
			continue
		}
		for entry := range strings.SplitSeq(v, ",") {
			if entry = strings.TrimSpace(entry); entry != "" {
				a, _ := referenceParseAddr(entry)
				hops = append(hops, a)
			}
		}
	}
	for i := len(hops) - 1; i >= 0; i-- {
		if !hops[i].IsValid() {
			return netip.Addr{}, false
		}
		addr = hops[i]
		if !r.isTrusted(addr) {
			break
		}
	}
	return addr, true
}

func referenceForwardedFor(hops []netip.Addr, v string) []netip.Addr {
	for v != "" {
		elem, rest, closed := cutUnquoted(v, ',')
		if !closed {
			return append(hops, netip.Addr{})
		}
		v = rest
		if elem = strings.TrimSpace(elem); elem == "" {
			continue
		}
		var node netip.Addr
		for elem != "" {
			var pair string
			pair, elem, _ = cutUnquoted(elem, ';')
			name, value, _ := strings.Cut(strings.TrimSpace(pair), "=")
			if strings.EqualFold(name, "for") {
				node, _ = referenceParseAddr(unwrap(value, '"', '"'))
				break
			}
		}
		hops = append(hops, node)
	}
	return hops
}

func referenceParsePeer(s string) (netip.Addr, bool) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap().WithZone(""), true
	}
	return referenceParseAddr(s)
}

func referenceParseAddr(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(unwrap(s, '[', ']'))
	if err != nil {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return netip.Addr{}, false
		}
		a = ap.Addr()
	}
	return a.Unmap().WithZone(""), true
}

func FuzzParseAddr(f *testing.F) {
	for _, s := range []string{"192.0.2.1", "192.0.2.1:80", "2001:db8::1", "[2001:db8::1]", "[2001:db8::1]:80",
		"fe80::1%eth0", "[fe80::1%eth0]:80", "::ffff:1.2.3.4", "[1.2.3.4]:80", "[::1", "1.2.3.4%x", "garbage", "", "[]"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		a, ok := parseAddr(s)
		ra, rok := referenceParseAddr(s)
		if a != ra || ok != rok {
			t.Fatalf("parseAddr(%q) = %v, %v; the reference gives %v, %v", s, a, ok, ra, rok)
		}
	})
}

func FuzzAddr(f *testing.F) {
	f.Add("10.0.0.1:1", "198.51.100.1, 203.0.113.7", "10.0.0.2", false)
	f.Add("10.0.0.1:1", "garbage, 10.0.0.2", "", false)
	f.Add("10.0.0.1:1", `for=198.51.100.66;x="`, "for=203.0.113.7", true)
	f.Add("10.0.0.1:1", `for=203.0.113.7;host="a\", for=198.51.100.9"`, `for="[2001:db8:ffff::1]:80", for=10.0.0.3`, true)
	f.Add("[2001:db8:ffff::1]:443", "for=_hidden, For=10.0.0.4;by=x", ", ,", true)
	f.Add("10.0.0.1:1", `for=203.0.113.7, for=garbage;x="a,\"b"`+strings.Repeat(", for=10.1.2.3", 20), "for=10.0.0.2", true)
	f.Fuzz(func(t *testing.T, peer, line1, line2 string, isForwarded bool) {
		o := Options{TrustedProxies: testProxies}
		name := xForwardedFor
		if isForwarded {
			o.ProxyHeader, name = forwarded, forwarded
		}
		r, err := New(o)
		require.NoError(t, err)
		h := header{name: {line1, line2}}
		a, ok := r.Addr(peer, h.values)
		ra, rok := referenceAddr(r, peer, h.values)
		if a != ra || ok != rok {
			t.Fatalf("Addr(%q, %q) = %v, %v; the reference gives %v, %v", peer, h[name], a, ok, ra, rok)
		}
		// KeyOf, given the peer as an address, agrees with Key.
		if pa, ok := parseAddr(peer); ok {
			k, kok := r.Key(peer, h.values)
			ko, kook := r.KeyOf(pa, h.values)
			if k != ko || kok != kook {
				t.Fatalf("KeyOf(%v, %q) = %q, %v; Key(%q) gives %q, %v", pa, h[name], ko, kook, peer, k, kok)
			}
		}
	})
}
