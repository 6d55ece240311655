package grpclimit

import (
	"context"
	"log/slog"

	"github.com/tollgate-go/tollgate"
)

// Acquirer is a RateLimiter that holds permits of concurrency plans
// (tollgate.Plan.Concurrency), as *tollgate.Limiter does: the server
// interceptors need one when a chain of WithPlans or WithMethodPlans
// names a concurrency plan.
//
// A call of that chain then acquires its permits, and its tokens of the
// other plans, in one Acquire, with WithCost's cost as n, and holds the
// permits until its handler returns (a stream's: until the stream ends),
// normally, by a panic, which goes on up once they are released, or
// after its client cancelled it, which does not stop a release. No free
// permit ends the call with codes.ResourceExhausted, without RetryInfo,
// retry-after or grpc-retry-pushback-ms, since a permit comes back when
// a call ends, on no schedule (see DeniedStatus); a denial by another
// plan of the chain keeps them.
type Acquirer interface {
	Acquire(ctx context.Context, key string, n int64, plans ...string) (*tollgate.Permit, error)
}

// defaulter is a RateLimiter that tells the plan of a call that names
// none, as *tollgate.Limiter does.
type defaulter interface {
	DefaultPlan() tollgate.Plan
}

// defaultPermits returns the name of l's default plan if calls that name
// the plans names take from it, since names is empty, and it is a
// concurrency plan, which AllowN and Wait refuse: every call would end
// codes.Internal. A *tollgate.Limiter keeps its default plan's kind
// (SetPlans), so what it finds at construction holds while it serves.
func defaultPermits(l any, names []string) (string, bool) {
	d, ok := l.(defaulter)
	if !ok || len(names) > 0 {
		return "", false
	}
	p := d.DefaultPlan()
	return p.Name, p.Concurrency
}

// WithReleaseErrorHandler sets what is told of a permit that could not be
// released once the handler returned: ctx is the call's, fullMethod its
// method, and err wraps tollgate.ErrPermitLost (its lease had ended, so
// its permits may have gone to others) or tollgate.ErrStoreUnavailable
// (the store failed; the permits come back when their lease ends), and
// never holds the key. The call's status is decided by then: h is the
// place to count or log. The default, or a nil h, logs err and the method
// at level Warn with slog.Default.
func WithReleaseErrorHandler(h func(ctx context.Context, fullMethod string, err error)) Option {
	return func(s *server) {
		if h != nil {
			s.releaseError = h
		}
	}
}

// chain is the plans a call takes from, and whether one of them is a
// concurrency plan, whose permits the call holds while its handler runs.
type chain struct {
	names   []string
	permits bool
}

// holdsPermits reports whether a chain of s names a concurrency plan.
func (s *server) holdsPermits() bool {
	for _, c := range s.methodPlans {
		if c.permits {
			return true
		}
	}
	return s.plans.permits
}

// release releases p, the permit of a call of fullMethod whose context is
// ctx, which may have ended: Release does not need it to.
func (s *server) release(ctx context.Context, fullMethod string, p *tollgate.Permit) {
	if err := p.Release(ctx); err != nil {
		s.releaseError(ctx, fullMethod, err)
	}
}

func logReleaseError(ctx context.Context, fullMethod string, err error) {
	slog.Default().LogAttrs(ctx, slog.LevelWarn, "grpclimit: releasing a permit failed",
		slog.String("method", fullMethod), slog.String("error", err.Error()))
}
