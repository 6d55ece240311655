package httplimit

import (
	"context"

	"github.com/tollgate-go/tollgate"
)

// resultKey is the context key of the decision on a request.
type resultKey struct{}

// WithResultInContext puts each decision in its request's context, where
// the handler, and the denied handler, read it with ResultFrom: to log
// what a shadowed plan would have denied (Result.ShadowDenied), or to
// tell a client its remaining quota in a body. It costs a copy of the
// request, two allocations, per request. The default leaves the context
// as it is.
func WithResultInContext() Option {
	return func(m *middleware) { m.inContext = true }
}

// ResultFrom returns the decision Middleware made on the request whose
// context is ctx, and whether there is one: only with WithResultInContext,
// and only for requests that were decided (not skipped, keyed, and
// without error).
func ResultFrom(ctx context.Context) (tollgate.Result, bool) {
	r, ok := ctx.Value(resultKey{}).(tollgate.Result)
	return r, ok
}
