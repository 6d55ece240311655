package httplimit

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
)

// ErrNoKey means a KeyFunc found no rate limit key in a request: a header
// is missing or empty, the client address is not an IP address, or the
// context holds no principal. The KeyFuncs of this package wrap it with
// detail, so match it with errors.Is. Middleware answers 400 by default
// (see WithKeyErrorHandler).
var ErrNoKey = errors.New("httplimit: no rate limit key in request")

// KeyFunc returns the rate limit key of a request: who is limited. An
// error, ErrNoKey for the KeyFuncs of this package, means the request
// carries no usable key; Middleware then answers 400, as it does for a
// key that is empty or longer than tollgate.MaxKeyLen bytes. Keys may be
// personal data, so a KeyFunc's errors must not contain them. Middleware
// calls its KeyFunc concurrently; those of this package are safe for that.
//
// The KeyFuncs of this package start their keys with their kind ("ip:",
// "header:NAME:", "principal:"), so keys of different kinds never meet in
// one Limiter: a client cannot send an API key that spells someone else's
// IP address and drain that address's buckets.
type KeyFunc func(*http.Request) (string, error)

// ByHeader keys requests by the first value of the header name, for
// example an API key: "header:X-Api-Key:" and the value. A missing or
// empty header is ErrNoKey. It panics if name is empty.
//
// Clients choose header values. Unless something before the middleware
// rejects unknown values, a client escapes its limit by sending a new
// value each time; behind authentication, ByPrincipal is the better key.
func ByHeader(name string) KeyFunc {
	if name == "" {
		panic("httplimit: ByHeader: empty header name")
	}
	name = http.CanonicalHeaderKey(name)
	prefix := "header:" + name + ":"
	errMissing := fmt.Errorf("%w: header %s missing or empty", ErrNoKey, name)
	return func(r *http.Request) (string, error) {
		v := r.Header.Get(name)
		if v == "" {
			return "", errMissing
		}
		return prefix + v, nil
	}
}

var errNoPrincipal = fmt.Errorf("%w: no principal in context", ErrNoKey)

// ByPrincipal keys requests by the authenticated principal that principal
// finds in the request's context, where the authentication middleware
// that runs before this one put it: "principal:" and the principal's ID.
// No principal, or an empty ID, is ErrNoKey.
func ByPrincipal(principal func(ctx context.Context) (id string, ok bool)) KeyFunc {
	return func(r *http.Request) (string, error) {
		id, ok := principal(r.Context())
		if !ok || id == "" {
			return "", errNoPrincipal
		}
		return "principal:" + id, nil
	}
}

// PerRoute gives every route its own buckets: the key is the route, '|'
// and the key of key, for example "GET /items/{id}|ip:203.0.113.7".
//
// The route is the ServeMux pattern that matched the request
// (Request.Pattern), so /items/1 and /items/2 share one bucket per client.
// That needs the middleware inside the mux, around the handler given to
// mux.Handle. Without a pattern (the middleware wraps the whole mux, or
// another router routes) the route is the escaped URL path. Then every
// distinct path has its own buckets: a client that varies the path
// (/items/1, /items/2, ...) escapes its limit, and the store holds a bucket
// per client and path. Use the path only where paths are few, or put a
// second Middleware, keyed without the route, in front.
//
// The route comes first and an escaped path holds no '|', so a client
// cannot make its key collide with another route's.
func PerRoute(key KeyFunc) KeyFunc {
	return func(r *http.Request) (string, error) {
		k, err := key(r)
		if err != nil {
			return "", err
		}
		route := r.Pattern
		if route == "" {
			route = r.URL.EscapedPath()
		}
		return route + "|" + k, nil
	}
}

// IPOptions configures ByIPWith. The zero value keys requests by the
// address of the connection's peer alone.
type IPOptions struct {
	// TrustedProxies are the networks of the reverse proxies in front of
	// the server. Only a request whose connection comes from one of them
	// is keyed by ProxyHeader, and then by the rightmost address in it
	// that is not in TrustedProxies: each trusted proxy appends the
	// address it got the request from, and anything further left may be
	// forged by the client. If every address is trusted, the leftmost one
	// is the key. The default is none.
	TrustedProxies []netip.Prefix
	// ProxyHeader is the header the trusted proxies append to:
	// "X-Forwarded-For" or "Forwarded" (RFC 7239). The other one is
	// ignored, since proxies that do not write a header pass a client's
	// forged one through. The default is "X-Forwarded-For".
	ProxyHeader string
	// IPv4Bits is the prefix length, 1 to 32, by which IPv4 addresses are
	// grouped into one key. The default is 32: one key per address.
	IPv4Bits int
	// IPv6Bits is the prefix length, 1 to 128, by which IPv6 addresses
	// are grouped into one key. The default is 64, since one host usually
	// holds a whole /64 and could take a fresh address, and fresh
	// buckets, for every request.
	IPv6Bits int
}

// ByIP keys requests by client IP address, trusting the proxy header
// X-Forwarded-For from trustedProxies only. It is ByIPWith with
// IPOptions{TrustedProxies: trustedProxies}.
func ByIP(trustedProxies ...netip.Prefix) KeyFunc {
	return ByIPWith(IPOptions{TrustedProxies: trustedProxies})
}

// ByIPWith keys requests by client IP address, as o describes: "ip:" and
// the address, or its network when grouped, in canonical form, such as
// "ip:203.0.113.7" or "ip:2001:db8:1:2::/64". IPv4-mapped IPv6 addresses
// count as IPv4 and zones are dropped. A request whose client address is
// not an IP address, such as one from a Unix socket or a proxy header
// entry that does not parse, is ErrNoKey.
//
// It panics if o holds an invalid prefix, an unknown ProxyHeader or a
// prefix length out of range.
func ByIPWith(o IPOptions) KeyFunc {
	k := &ipKeyer{v4Bits: cmp.Or(o.IPv4Bits, 32), v6Bits: cmp.Or(o.IPv6Bits, 64)}
	if k.v4Bits < 1 || k.v4Bits > 32 {
		panic(fmt.Sprintf("httplimit: IPOptions.IPv4Bits %d is not 1 to 32", o.IPv4Bits))
	}
	if k.v6Bits < 1 || k.v6Bits > 128 {
		panic(fmt.Sprintf("httplimit: IPOptions.IPv6Bits %d is not 1 to 128", o.IPv6Bits))
	}
	switch http.CanonicalHeaderKey(o.ProxyHeader) {
	case "", "X-Forwarded-For":
	case "Forwarded":
		k.forwarded = true
	default:
		panic(fmt.Sprintf("httplimit: IPOptions.ProxyHeader %q is neither X-Forwarded-For nor Forwarded", o.ProxyHeader))
	}
	for _, p := range o.TrustedProxies {
		if !p.IsValid() {
			panic("httplimit: IPOptions.TrustedProxies holds an invalid prefix")
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		k.trusted = append(k.trusted, p.Masked())
	}
	return k.key
}

type ipKeyer struct {
	trusted   []netip.Prefix
	forwarded bool // the proxy header is Forwarded, not X-Forwarded-For
	v4Bits    int
	v6Bits    int
}

var errNoAddr = fmt.Errorf("%w: client address is not an IP address", ErrNoKey)

func (k *ipKeyer) key(r *http.Request) (string, error) {
	addr, ok := parsePeer(r.RemoteAddr)
	if !ok {
		return "", errNoAddr
	}
	if k.isTrusted(addr) {
		var buf [8]netip.Addr
		hops := k.hops(r.Header, buf[:0])
		for i := len(hops) - 1; i >= 0; i-- {
			if !hops[i].IsValid() {
				return "", errNoAddr
			}
			addr = hops[i]
			if !k.isTrusted(addr) {
				break
			}
		}
	}
	return k.format(addr), nil
}

func (k *ipKeyer) isTrusted(a netip.Addr) bool {
	for _, p := range k.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// hops appends the addresses of the proxy header to hops, leftmost first,
// across all its field lines. An entry that is not an IP address appends
// the zero Addr. Empty list elements are skipped (RFC 9110, 5.6.1).
func (k *ipKeyer) hops(h http.Header, hops []netip.Addr) []netip.Addr {
	if k.forwarded {
		for _, v := range h["Forwarded"] {
			hops = appendForwardedFor(hops, v)
		}
		return hops
	}
	for _, v := range h["X-Forwarded-For"] {
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

// parsePeer parses Request.RemoteAddr, which is "host:port" for TCP.
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
func (k *ipKeyer) format(a netip.Addr) string {
	bits := k.v6Bits
	if a.Is4() {
		bits = k.v4Bits
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
