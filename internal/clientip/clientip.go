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
//
// Clients choose what the proxy header holds left of what the proxies
// append, so Addr walks it from the right and stops at the client: it
// builds no list and parses nothing further left. An X-Forwarded-For
// header then costs the same however long it is. A Forwarded line is
// scanned once from the left, since only that tells quoted commas from
// separators (see commas), but its elements are parsed from the right.
// Neither allocates, unless the entry that ends the walk looks like an
// address and is none: then netip allocates its error, once.
func (r *Resolver) Addr(peer string, header Header) (netip.Addr, bool) {
	addr, ok := parseAddr(peer)
	if !ok {
		return addr, false
	}
	return r.from(addr, header)
}

// KeyOf is Key for a peer that is an address already, as gRPC's peer
// address (a *net.TCPAddr) holds it, which spares formatting the address
// and parsing it again. It reports false if peer is not valid.
func (r *Resolver) KeyOf(peer netip.Addr, header Header) (string, bool) {
	if !peer.IsValid() {
		return "", false
	}
	a, ok := r.from(peer.Unmap().WithZone(""), header)
	if !ok {
		return "", false
	}
	return r.format(a), true
}

// from is Addr for a peer address already parsed, unmapped and without
// a zone.
func (r *Resolver) from(addr netip.Addr, header Header) (netip.Addr, bool) {
	if !r.isTrusted(addr) {
		return addr, true
	}
	lines := header(r.header)
	for i := len(lines) - 1; i >= 0; i-- {
		var done bool
		if r.header == forwarded {
			addr, done = r.walkForwarded(lines[i], addr)
		} else {
			addr, done = r.walkXFF(lines[i], addr)
		}
		if done {
			return addr, addr.IsValid()
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

// The walks take a field line's hops from the right, after the hops of
// the lines below it. Each returns done and the hop that ends the walk:
// the first one that is untrusted, or the zero Addr for one that is not
// an address. Otherwise it returns the leftmost hop of the line, or addr
// if the line has none, and the walk goes on to the line above. Empty
// list elements are no hops (RFC 9110, section 5.6.1).

// walkXFF walks an X-Forwarded-For line: addresses separated by commas.
func (r *Resolver) walkXFF(v string, addr netip.Addr) (_ netip.Addr, done bool) {
	for v != "" {
		var entry string
		if i := strings.LastIndexByte(v, ','); i >= 0 {
			v, entry = v[:i], v[i+1:]
		} else {
			v, entry = "", v
		}
		if entry = strings.TrimSpace(entry); entry == "" {
			continue
		}
		a, _ := parseAddr(entry)
		if !a.IsValid() || !r.isTrusted(a) {
			return a, true
		}
		addr = a
	}
	return addr, false
}

// walkForwarded walks a Forwarded line (RFC 7239, section 4), such as
// `for=192.0.2.60;proto=http, for="[2001:db8:cafe::17]:4711"`: a hop is
// the "for" node of an element.
//
// A quoted-string left open makes the line's last hop the zero Addr:
// otherwise a client's `x="` would swallow the elements that trusted
// proxies append after it, and its own address would be taken.
func (r *Resolver) walkForwarded(v string, addr netip.Addr) (_ netip.Addr, done bool) {
	var c commas
	if !c.scan(v) {
		return netip.Addr{}, true
	}
	end := len(v)
	for k := c.n - 1; k >= -1; k-- { // the element after comma k
		start := 0
		if k >= 0 {
			at, ok := c.offset(k)
			if !ok {
				return r.walkForwardedFromLeft(v[:end], addr)
			}
			start = at + 1
		}
		elem := strings.TrimSpace(v[start:end])
		end = start - 1
		if elem == "" {
			continue
		}
		a := forwardedFor(elem)
		if !a.IsValid() || !r.isTrusted(a) {
			return a, true
		}
		addr = a
	}
	return addr, false
}

// walkForwardedFromLeft walks the elements of a Forwarded line whose
// quoted-strings are closed from the left, for the rare line that has
// more trusted elements at its end than commas remembers. It keeps only
// the rightmost hop that ends the walk and the leftmost hop, so it needs
// no list either, but it parses every element.
func (r *Resolver) walkForwardedFromLeft(v string, addr netip.Addr) (_ netip.Addr, done bool) {
	var ended, leftmost netip.Addr
	for v != "" {
		var elem string
		elem, v, _ = cutUnquoted(v, ',')
		if elem = strings.TrimSpace(elem); elem == "" {
			continue
		}
		a := forwardedFor(elem)
		switch {
		case !a.IsValid() || !r.isTrusted(a):
			ended, done = a, true
		case !leftmost.IsValid():
			leftmost = a
		}
	}
	if done {
		return ended, true
	}
	if leftmost.IsValid() {
		return leftmost, false
	}
	return addr, false
}

// commas finds the commas that separate the elements of a Forwarded line,
// those outside quoted-strings, and remembers the offsets of the last
// len(at). Whether a comma is quoted depends on everything left of it, so
// no scan from the right can tell; a fixed array keeps the scan from the
// left free of allocation, and is enough for every proxy chain in
// practice.
type commas struct {
	at [16]int // the offset of comma i is at[i%len(at)]
	n  int     // the separating commas in the line
}

// scan finds the separating commas of v, and reports whether every
// quoted-string in v is closed.
func (c *commas) scan(v string) (closed bool) {
	quoted := false
	for i := 0; i < len(v); i++ {
		switch v[i] {
		case '\\':
			if quoted {
				i++ // a quoted-pair: the next byte is not special
			}
		case '"':
			quoted = !quoted
		case ',':
			if !quoted {
				c.at[c.n%len(c.at)] = i
				c.n++
			}
		}
	}
	return !quoted
}

// offset returns the offset of comma k, if it is among the remembered.
func (c *commas) offset(k int) (int, bool) {
	if k < c.n-len(c.at) {
		return 0, false
	}
	return c.at[k%len(c.at)], true
}

// forwardedFor returns the "for" node of a Forwarded element, or the zero
// Addr if it has none or the node is not an IP address ("unknown",
// "_hidden").
func forwardedFor(elem string) netip.Addr {
	for elem != "" {
		var pair string
		pair, elem, _ = cutUnquoted(elem, ';') // closed: the line was
		name, value, _ := strings.Cut(strings.TrimSpace(pair), "=")
		if strings.EqualFold(name, "for") {
			a, _ := parseAddr(unwrap(value, '"', '"'))
			return a
		}
	}
	return netip.Addr{}
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

// parseAddr parses an address as peers and proxies write it: "192.0.2.1",
// "192.0.2.1:80", "2001:db8::1", "[2001:db8::1]" or "[2001:db8::1]:80".
// It makes one call into netip, which allocates the error of every
// failure, and none for text made of what no address is made of, such as
// "unknown" or "garbage": clients write proxy header entries.
func parseAddr(s string) (netip.Addr, bool) {
	if !addrBytes(s) {
		return netip.Addr{}, false
	}
	var a netip.Addr
	var err error
	switch {
	case s[0] == '[' && s[len(s)-1] == ']':
		a, err = netip.ParseAddr(s[1 : len(s)-1])
	case s[0] == '[' || strings.Count(s, ":") == 1:
		var ap netip.AddrPort
		ap, err = netip.ParseAddrPort(s)
		a = ap.Addr()
	default: // IPv4 has no colon, and IPv6 without brackets at least two
		a, err = netip.ParseAddr(s)
	}
	if err != nil {
		return netip.Addr{}, false
	}
	return a.Unmap().WithZone(""), true
}

// addrBytes reports whether s could be an address for parseAddr: it is not
// empty, and up to a zone ('%' and anything) it holds hexadecimal digits,
// '.', ':', '[' and ']' only.
func addrBytes(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '%':
			return true
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f', 'A' <= c && c <= 'F',
			c == '.', c == ':', c == '[', c == ']':
		default:
			return false
		}
	}
	return s != ""
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
