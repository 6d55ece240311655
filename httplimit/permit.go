package httplimit

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/tollgate-go/tollgate"
)

// Acquirer is a RateLimiter that holds permits of concurrency plans
// (tollgate.Plan.Concurrency), as *tollgate.Limiter does: Middleware
// needs one when WithPlans names a concurrency plan.
//
// A request then acquires its permits, and its tokens of the other plans
// named, in one Acquire, with WithCost's cost as n, and holds the permits
// until its handler returns: normally, by a panic, which goes on up once
// they are released, or after its client hung up, which does not stop a
// release. The permit ends when the handler the middleware wraps returns:
// work that outlives it (a handler behind http.TimeoutHandler, which
// returns at its timeout while the inner handler runs on, or a hijacked
// connection served by a goroutine of its own) runs without one, so wrap
// such work in the middleware from the inside, or acquire in it. No free
// permit is 429 Too Many Requests without Retry-After,
// since a permit comes back when a request ends, on no schedule; a
// denial by another plan of the chain keeps its Retry-After.
type Acquirer interface {
	Acquire(ctx context.Context, key string, n int64, plans ...string) (*tollgate.Permit, error)
}

// defaulter is a RateLimiter that tells the plan of a call that names
// none, as *tollgate.Limiter does.
type defaulter interface {
	DefaultPlan() tollgate.Plan
}

// checkDefault panics if requests take from the RateLimiter's default
// plan (no WithPlans) and it is a concurrency plan, which AllowN refuses:
// every request would be answered 500. A *tollgate.Limiter keeps its
// default plan's kind (SetPlans), so this holds while it serves.
func (m *middleware) checkDefault() {
	d, ok := m.lim.(defaulter)
	if !ok || len(m.plans) > 0 {
		return
	}
	if p := d.DefaultPlan(); p.Concurrency {
		panic(fmt.Sprintf("httplimit: Middleware: the default plan %q is a concurrency plan: name it in WithPlans", p.Name))
	}
}

// WithReleaseErrorHandler sets what is told of a permit that could not be
// released once the handler returned: err wraps tollgate.ErrPermitLost
// (its lease had ended, so its permits may have gone to others) or
// tollgate.ErrStoreUnavailable (the store failed; the permits come back
// when their lease ends), and never holds the key. The response is sent
// by then: h is the place to count or log. The default, or a nil h, logs
// err at level Warn with slog.Default.
func WithReleaseErrorHandler(h func(r *http.Request, err error)) Option {
	return func(m *middleware) {
		if h != nil {
			m.releaseError = h
		}
	}
}

// servePermit calls next for a request that holds permit p, and releases
// p when next returns or panics, so that the panic goes on up with p
// released.
func (m *middleware) servePermit(w http.ResponseWriter, r *http.Request, p *tollgate.Permit, next http.Handler) {
	defer m.release(r, p)
	next.ServeHTTP(w, r)
}

// release releases p, under r's context, which may have ended: Release
// does not need it to.
func (m *middleware) release(r *http.Request, p *tollgate.Permit) {
	if err := p.Release(r.Context()); err != nil {
		m.releaseError(r, err)
	}
}

func logReleaseError(r *http.Request, err error) {
	slog.Default().LogAttrs(r.Context(), slog.LevelWarn, "httplimit: releasing a permit failed", slog.String("error", err.Error()))
}
