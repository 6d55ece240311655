package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/tollgate-go/tollgate/internal/clientip"
)

// ErrNoKey means a KeyFunc found no rate limit key in a call: a metadata
// value is missing or empty, the peer address is not an IP address, or
// the context holds no principal. The KeyFuncs of this package wrap it
// with detail, so match it with errors.Is. The server interceptors answer
// codes.InvalidArgument by default (see WithErrorStatus).
var ErrNoKey = errors.New("grpclimit: no rate limit key in call")

// KeyFunc returns the rate limit key of a call: who is limited. ctx is the
// call's context (on a server, the incoming metadata and the peer are in
// it) and fullMethod the method's full name, "/package.Service/Method".
//
// An error, ErrNoKey for the KeyFuncs of this package, means the call
// carries no usable key; the server interceptors then answer
// codes.InvalidArgument, as they do for a key that is empty or longer than
// tollgate.MaxKeyLen bytes. Keys may be personal data, so a KeyFunc's
// errors must not contain them: the interceptors never send them, but a
// WithErrorStatus function sees them. The interceptors call their KeyFunc
// concurrently; those of this package are safe for that.
//
// The KeyFuncs of this package start their keys with their kind ("ip:",
// "md:NAME:", "principal:"), so keys of different kinds never meet in one
// Limiter: a client cannot send a metadata value that spells someone
// else's IP address and drain that address's buckets. They are the same
// keys as httplimit's for the same client, except that httplimit's
// header keys start "header:", so an HTTP and a gRPC front end that share
// a Limiter share the buckets of an IP address or a principal.
//
// A plan resolver (tollgate.WithPlanResolver) behind the interceptors is given the value the
// key holds after its kind and method (tollgate.ResolveAs): the API key
// "key-gold" of the bucket "md:x-api-key:key-gold", the principal's ID,
// the address, so that a resolver of customer tiers matches the key the
// customer sent. A key of another shape, such as Key's or a KeyFunc's of
// your own, is given as it is. Behind one Limiter that KeyFuncs of several
// kinds feed, a resolver cannot tell their values apart.
type KeyFunc func(ctx context.Context, fullMethod string) (string, error)

// Key keys every call by key, which must not be empty: for a client
// interceptor, this is usually the upstream it paces ("upstream:billing"),
// so that all calls to it share one budget. It panics if key is empty.
func Key(key string) KeyFunc {
	if key == "" {
		panic("grpclimit: Key: empty key")
	}
	return func(context.Context, string) (string, error) { return key, nil }
}

// ByMetadata keys calls by the first value of the incoming metadata entry
// name, for example an API key: "md:" and the name, ':' and the value.
// The name is matched in lower case, as gRPC sends metadata names. A
// missing or empty value is ErrNoKey.
//
// It panics if name is empty, holds characters a metadata name cannot
// hold (anything but a-z, 0-9, '-', '_' and '.', in either case), or ends
// in "-bin": binary values are arbitrary bytes, which make poor keys and
// may hold anything, such as a whole credential.
//
// Clients choose metadata values. Unless something before the interceptor
// rejects unknown values, a client escapes its limit by sending a new
// value each time; behind authentication, ByPrincipal is the better key.
func ByMetadata(name string) KeyFunc {
	name = strings.ToLower(name)
	switch {
	case name == "":
		panic("grpclimit: ByMetadata: empty metadata name")
	case strings.HasSuffix(name, "-bin"):
		panic(fmt.Sprintf("grpclimit: ByMetadata: %q is a binary metadata name; binary values are refused as keys", name))
	case strings.TrimLeft(name, "abcdefghijklmnopqrstuvwxyz0123456789-_.") != "":
		panic(fmt.Sprintf("grpclimit: ByMetadata: %q is not a valid metadata name", name))
	}
	prefix := "md:" + name + ":"
	errMissing := fmt.Errorf("%w: metadata %s missing or empty", ErrNoKey, name)
	return func(ctx context.Context, _ string) (string, error) {
		// Not FromIncomingContext, which copies the whole map.
		v := metadata.ValueFromIncomingContext(ctx, name)
		if len(v) == 0 || v[0] == "" {
			return "", errMissing
		}
		return prefix + v[0], nil
	}
}

var errNoPrincipal = fmt.Errorf("%w: no principal in context", ErrNoKey)

// ByPrincipal keys calls by the authenticated principal that principal
// finds in the call's context, where an authentication interceptor that
// runs before this one put it (or the peer's TLS certificate, through
// peer.FromContext): "principal:" and the principal's ID. No principal,
// or an empty ID, is ErrNoKey. It panics if principal is nil.
func ByPrincipal(principal func(ctx context.Context) (id string, ok bool)) KeyFunc {
	if principal == nil {
		panic("grpclimit: ByPrincipal: nil principal func")
	}
	return func(ctx context.Context, _ string) (string, error) {
		id, ok := principal(ctx)
		if !ok || id == "" {
			return "", errNoPrincipal
		}
		return "principal:" + id, nil
	}
}

// PerMethod gives every method its own buckets: the key is the method's
// full name, '|' and the key of key, for example
// "/shop.Cart/Add|ip:203.0.113.7". Method names hold no '|', so a client
// cannot make its key collide with another method's. It panics if key is
// nil.
func PerMethod(key KeyFunc) KeyFunc {
	if key == nil {
		panic("grpclimit: PerMethod: nil KeyFunc")
	}
	return func(ctx context.Context, fullMethod string) (string, error) {
		k, err := key(ctx, fullMethod)
		if err != nil {
			return "", err
		}
		return fullMethod + "|" + k, nil
	}
}

// IPOptions configures ByPeerIPWith. The zero value keys calls by the
// address of the connection's peer alone. It has the fields of
// httplimit.IPOptions, with the same rules.
type IPOptions struct {
	// TrustedProxies are the networks of the proxies in front of the
	// server (an Envoy or a load balancer that speaks HTTP/2). Only a
	// call whose connection comes from one of them is keyed by
	// ProxyHeader, and then by the rightmost address in it that is not in
	// TrustedProxies: each trusted proxy appends the address it got the
	// call from, and anything further left may be forged by the client.
	// If every address is trusted, the leftmost one is the key. The
	// default is none.
	TrustedProxies []netip.Prefix
	// ProxyHeader is the metadata entry the trusted proxies append to:
	// "x-forwarded-for" or "forwarded" (RFC 7239), in any letter case.
	// The default is "x-forwarded-for".
	ProxyHeader string
	// IPv4Bits is the prefix length, 1 to 32, by which IPv4 addresses are
	// grouped into one key. The default is 32: one key per address.
	IPv4Bits int
	// IPv6Bits is the prefix length, 1 to 128, by which IPv6 addresses
	// are grouped into one key. The default is 64, since one host usually
	// holds a whole /64 and could take a fresh address, and fresh
	// buckets, for every call.
	IPv6Bits int
}

// ByPeerIP keys calls by client IP address, trusting the x-forwarded-for
// metadata from trustedProxies only. It is ByPeerIPWith with
// IPOptions{TrustedProxies: trustedProxies}.
func ByPeerIP(trustedProxies ...netip.Prefix) KeyFunc {
	return ByPeerIPWith(IPOptions{TrustedProxies: trustedProxies})
}

// lower returns a proxy header's name as gRPC sends metadata names.
func lower(name string) string {
	switch name { // the names a clientip.Resolver asks for
	case "X-Forwarded-For":
		return "x-forwarded-for"
	case "Forwarded":
		return "forwarded"
	}
	return strings.ToLower(name)
}

var errNoAddr = fmt.Errorf("%w: client address is not an IP address", ErrNoKey)

// ByPeerIPWith keys calls by client IP address, as o describes: "ip:" and
// the address, or its network when grouped, in canonical form, such as
// "ip:203.0.113.7" or "ip:2001:db8:1:2::/64", the keys httplimit.ByIPWith
// gives. The peer is the one grpc-go puts in the call's context
// (peer.FromContext). IPv4-mapped IPv6 addresses count as IPv4 and zones
// are dropped. A call whose client address is not an IP address, such as
// one over a Unix socket or an in-memory connection, or a proxy entry that
// does not parse, is ErrNoKey.
//
// It panics if o holds an invalid prefix, an unknown ProxyHeader or a
// prefix length out of range.
func ByPeerIPWith(o IPOptions) KeyFunc {
	res, err := clientip.New(clientip.Options(o))
	if err != nil {
		panic("grpclimit: IPOptions." + err.Error())
	}
	return func(ctx context.Context, _ string) (string, error) {
		p, ok := peer.FromContext(ctx)
		if !ok || p.Addr == nil {
			return "", errNoAddr
		}
		header := func(name string) []string {
			return metadata.ValueFromIncomingContext(ctx, lower(name))
		}
		var key string
		if a, isTCP := p.Addr.(*net.TCPAddr); isTCP {
			key, ok = res.KeyOf(a.AddrPort().Addr(), header) // no string to build and parse
		} else {
			key, ok = res.Key(p.Addr.String(), header)
		}
		if !ok {
			return "", errNoAddr
		}
		return key, nil
	}
}
