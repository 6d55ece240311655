// Package callerkey finds, within a key that a KeyFunc of httplimit or
// grpclimit built, the key the caller meant, for a plan resolver to see.
package callerkey

import (
	"context"
	"strings"

	"github.com/tollgate-go/tollgate"
)

// Of returns the value within key after its kind ("ip:", "principal:",
// "header:NAME:", "md:NAME:"), past the routes or methods that PerRoute
// and PerMethod put before it ("ROUTE|"): "key-gold" within
// "GET /items/{id}|header:X-Api-Key:key-gold". A key of no kind, such as
// grpclimit.Key's or a KeyFunc's of one's own, is its own.
func Of(key string) string {
	for rest := key; ; {
		if v, ok := value(rest); ok {
			return v
		}
		var found bool
		if _, rest, found = strings.Cut(rest, "|"); !found {
			return key
		}
	}
}

// value returns the value after key's kind, if key starts with a kind.
func value(key string) (string, bool) {
	kind, rest, ok := strings.Cut(key, ":")
	if !ok {
		return "", false
	}
	switch kind {
	case "ip", "principal":
		return rest, rest != ""
	case "header", "md": // a header's or metadata's name holds no ':'
		_, v, ok := strings.Cut(rest, ":")
		return v, ok && v != ""
	}
	return "", false
}

// Context returns ctx, in which a decision on key gives a plan resolver the
// key the caller meant (Of), if that is not key itself
// (tollgate.ResolveAs).
func Context(ctx context.Context, key string) context.Context {
	if as := Of(key); as != key {
		return tollgate.ResolveAs(ctx, key, as)
	}
	return ctx
}
