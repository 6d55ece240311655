package httplimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"

	"github.com/tollgate-go/tollgate/internal/clientip"
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
//
// A plan resolver (tollgate.WithPlanResolver) behind Middleware is given the value the key
// holds after its kind and route (tollgate.ResolveAs): the API key
// "key-gold" of the bucket "header:X-Api-Key:key-gold", the principal's
// ID, the address, so that a resolver of customer tiers matches the key
// the customer sent. A key of another shape, from a KeyFunc of your own,
// is given as it is. Behind one Limiter that KeyFuncs of several kinds
// feed, a resolver cannot tell their values apart: an address looks the
// same whether it came as one or as a header's value.
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
// No principal, or an empty ID, is ErrNoKey. It panics if principal is
// nil, when called rather than on the first request.
func ByPrincipal(principal func(ctx context.Context) (id string, ok bool)) KeyFunc {
	if principal == nil {
		panic("httplimit: ByPrincipal: nil principal func")
	}
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
//
// It panics if key is nil, when called rather than on the first
// request.
func PerRoute(key KeyFunc) KeyFunc {
	if key == nil {
		panic("httplimit: PerRoute: nil KeyFunc")
	}
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
	// "X-Forwarded-For" or "Forwarded" (RFC 7239), in any letter case.
	// The other one is ignored, since proxies that do not write a header
	// pass a client's forged one through. The default is
	// "X-Forwarded-For".
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
	res, err := clientip.New(clientip.Options(o))
	if err != nil {
		panic("httplimit: IPOptions." + err.Error())
	}
	return func(r *http.Request) (string, error) {
		key, ok := res.Key(r.RemoteAddr, r.Header.Values)
		if !ok {
			return "", errNoAddr
		}
		return key, nil
	}
}

var errNoAddr = fmt.Errorf("%w: client address is not an IP address", ErrNoKey)
