// Package clientip finds the IP address of the client that sent a request
// through the reverse proxies in front of a server, and makes it a rate
// limit key. It serves the net/http middleware (httplimit) and is meant to
// serve the gRPC interceptors (grpclimit) too, so it knows neither: it
// takes the connection's peer address as a string and the request's
// header fields, or gRPC metadata, as a Header function.
package clientip

import (
	"cmp"
	"fmt"
	"net/netip"
	"strings"
)

// Options says which proxies to trust and how to group addresses into
// keys. httplimit.IPOptions has the same fields and converts to it.
type Options struct {
	// TrustedProxies are the networks of the reverse proxies in front of
	// the server. Only a request whose connection comes from one of them
	// is keyed by ProxyHeader, and then by the rightmost address in it
	// that is not in TrustedProxies. The default is none.
	TrustedProxies []netip.Prefix
	// ProxyHeader is the header the trusted proxies append to, in any
	// case: "X-Forwarded-For" or "Forwarded" (RFC 7239). The default is
	// "X-Forwarded-For".
	ProxyHeader string
	// IPv4Bits is the prefix length, 1 to 32, by which IPv4 addresses are
	// grouped into one key. The default is 32.
	IPv4Bits int
	// IPv6Bits is the prefix length, 1 to 128, by which IPv6 addresses
	// are grouped into one key. The default is 64.
	IPv6Bits int
}

// Header returns the field lines of the header field name, in the order
// received, or nil if there are none. Resolvers ask for the names in
// canonical form ("X-Forwarded-For", "Forwarded"), and both
// http.Header.Values and gRPC's metadata.MD.Get, which match names in any
// case, are Headers.
type Header func(name string) []string

// Resolver finds client addresses as its Options say. It is safe for
// concurrent use.
type Resolver struct {
	trusted []netip.Prefix
	header  string // the canonical name of the proxy header
	v4Bits  int
	v6Bits  int
}

// New returns a Resolver for o. Its error names the field of o at fault,
// as in "IPv4Bits 33 is not 1 to 32", without a package prefix: the
// caller puts its own name for the options in front.
func New(o Options) (*Resolver, error) {
	r := &Resolver{v4Bits: cmp.Or(o.IPv4Bits, 32), v6Bits: cmp.Or(o.IPv6Bits, 64)}
	if r.v4Bits < 1 || r.v4Bits > 32 {
		return nil, fmt.Errorf("IPv4Bits %d is not 1 to 32", o.IPv4Bits)
	}
	if r.v6Bits < 1 || r.v6Bits > 128 {
		return nil, fmt.Errorf("IPv6Bits %d is not 1 to 128", o.IPv6Bits)
	}
	switch {
	case o.ProxyHeader == "" || strings.EqualFold(o.ProxyHeader, xForwardedFor):
		r.header = xForwardedFor
	case strings.EqualFold(o.ProxyHeader, forwarded):
		r.header = forwarded
	default:
		return nil, fmt.Errorf("ProxyHeader %q is neither %s nor %s", o.ProxyHeader, xForwardedFor, forwarded)
	}
	for _, p := range o.TrustedProxies {
		if !p.IsValid() {
			return nil, fmt.Errorf("TrustedProxies holds an invalid prefix")
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		r.trusted = append(r.trusted, p.Masked())
	}
	return r, nil
}

const (
	xForwardedFor = "X-Forwarded-For"
	forwarded     = "Forwarded"
)

// Key returns the rate limit key of the client: "ip:" and its address
// (see Addr), or the address's network when IPv4Bits or IPv6Bits group
// it, in canonical form, such as "ip:203.0.113.7" or
// "ip:2001:db8:1:2::/64". It reports false when Addr does.
func (r *Resolver) Key(peer string, header Header) (string, bool) {
	a, ok := r.Addr(peer, header)
	if !ok {
		return "", false
	}
	return r.format(a), true
}

// Addr returns the client's address. peer is the address of the
// connection's other end, as "host:port" (Request.RemoteAddr, or gRPC's
// peer.Addr.String()) or a bare host. If peer is a trusted proxy, the
// client is the rightmost address in the proxy header that is not
// trusted: each trusted proxy appends the address it got the request
// from, and anything further left may be forged by the client. If every
// address is trusted, it is the leftmost one. IPv4-mapped IPv6 addresses
// count as IPv4 and zones are dropped.
//
// Addr reports false if the client's address is not an IP address: a
// peer from a Unix socket, or a proxy header entry that does not parse
// where the client's address should be.
func (r *Resolver) Addr(peer string, header Header) (netip.Addr, bool) {
	addr, ok := parsePeer(peer)
	if !ok {
		return netip.Addr{}, false
	}
	if r.isTrusted(addr) {
		var buf [8]netip.Addr
		hops := r.hops(header, buf[:0])
		for i := len(hops) - 1; i >= 0; i-- {
			if !hops[i].IsValid() {
				return netip.Addr{}, false
			}
			addr = hops[i]
			if !r.isTrusted(addr) {
				break
			}
		}
	}
	return addr, true
}

func (r *Resolver) isTrusted(a netip.Addr) bool {
	for _, p := range r.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// hops appends the addresses of the proxy header to hops, leftmost first,
// across all its field lines. An entry that is not an IP address appends
// the zero Addr. Empty list elements are skipped (RFC 9110, 5.6.1).
func (r *Resolver) hops(header Header, hops []netip.Addr) []netip.Addr {
	if r.header == forwarded {
		for _, v := range header(forwarded) {
			hops = appendForwardedFor(hops, v)
		}
		return hops
	}
	for _, v := range header(xForwardedFor) {
		for entry := range strings.SplitSeq(v, ",") {
			if entry = strings.TrimSpace(entry); entry != "" {
				a, _ := parseAddr(entry)
				hops = append(hops, a)
			}
		}
	}
	return hops
}

// appendForwardedFor appends the "for" node of every element of a
// Forwarded field value (RFC 7239, section 4), such as
// `for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711"`. An element
// without one, or whose node is not an IP address ("unknown", "_hidden"),
// appends the zero Addr. A quoted-string left open ends the value with the
// zero Addr: otherwise a client's `x="` would swallow the elements that
// trusted proxies append after it, and its own address would be taken.
func appendForwardedFor(hops []netip.Addr, v string) []netip.Addr {
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
			pair, elem, _ = cutUnquoted(elem, ';') // closed: the element was
			name, value, _ := strings.Cut(strings.TrimSpace(pair), "=")
			if strings.EqualFold(name, "for") {
				node, _ = parseAddr(unwrap(value, '"', '"'))
				break
			}
		}
		hops = append(hops, node)
	}
	return hops
}

// cutUnquoted cuts s around the first sep outside a quoted-string, and
// reports whether every quoted-string before the cut is closed.
func cutUnquoted(s string, sep byte) (before, after string, closed bool) {
	quoted := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case quoted && c == '\\':
			i++
		case c == '"':
			quoted = !quoted
		case !quoted && c == sep:
			return s[:i], s[i+1:], true
		}
	}
	return s, "", !quoted
}

// parsePeer parses a peer address, which is "host:port" for TCP.
func parsePeer(s string) (netip.Addr, bool) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap().WithZone(""), true
	}
	return parseAddr(s)
}

// parseAddr parses an address as proxies write it: "192.0.2.1",
// "192.0.2.1:80", "2001:db8::1", "[2001:db8::1]" or "[2001:db8::1]:80".
func parseAddr(s string) (netip.Addr, bool) {
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

// unwrap returns s without its first and last byte if they are open and
// close, and s otherwise.
func unwrap(s string, open, close byte) string {
	if len(s) >= 2 && s[0] == open && s[len(s)-1] == close {
		return s[1 : len(s)-1]
	}
	return s
}

// format returns the key of a: "ip:" and a, or its network when a is
// grouped with others.
func (r *Resolver) format(a netip.Addr) string {
	bits := r.v6Bits
	if a.Is4() {
		bits = r.v4Bits
	}
	var buf [64]byte
	b := append(buf[:0], "ip:"...)
	if bits == a.BitLen() {
		b = a.AppendTo(b)
	} else {
		p, _ := a.Prefix(bits) // cannot fail: bits is in range and a has no zone
		b = p.AppendTo(b)
	}
	return string(b)
}
