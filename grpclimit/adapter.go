package grpclimit

import (
	"context"

	"google.golang.org/grpc"

	"github.com/tollgate-go/tollgate"
)

// MiddlewareLimiter adapts a RateLimiter to the ratelimit.Limiter
// interface of go-grpc-middleware v2
// (github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit),
// for programs that already chain that middleware. Make one with
// NewMiddlewareLimiter. It is safe for concurrent use.
//
// It decides as UnaryServerInterceptor does, and on a server it sets the
// same metadata (the IETF fields, retry-after and grpc-retry-pushback-ms)
// through the call's context. What it loses is the status: that
// middleware turns every error from Limit into codes.ResourceExhausted
// with the error's text in the message. So the details of DeniedStatus
// (RetryInfo, QuotaFailure, ErrorInfo) are lost, as is the code of every
// other outcome: a store outage under FailClosed, a call without a key
// and a caller's ended context all reach the client as ResourceExhausted,
// which tells a client to back off from a server that may be healthy. The
// text of the status this package would have sent survives in the
// message, and never holds a key. The interceptors of this package lose
// none of it.
type MiddlewareLimiter struct {
	s *server
}

// NewMiddlewareLimiter returns a MiddlewareLimiter. Its options and
// panics are those of UnaryServerInterceptor; WithStreamMessages has no
// effect, since go-grpc-middleware asks once per call or stream. It also
// panics if a plan is a concurrency plan: go-grpc-middleware asks before
// the handler and never after, so nothing would release the permit.
func NewMiddlewareLimiter(l tollgate.RateLimiter, key KeyFunc, opts ...Option) *MiddlewareLimiter {
	s := newServer("NewMiddlewareLimiter", l, key, opts)
	if s.holdsPermits() {
		panic("grpclimit: NewMiddlewareLimiter: a concurrency plan's permit needs the interceptors of this package, which release it")
	}
	return &MiddlewareLimiter{s: s}
}

// Limit decides the call whose context is ctx, finding its method with
// grpc.Method(ctx). It returns nil if the call may proceed, and else a
// status error as UnaryServerInterceptor's.
func (m *MiddlewareLimiter) Limit(ctx context.Context) error {
	s := m.s
	method, _ := grpc.Method(ctx)
	if s.skip != nil && s.skip(ctx, method) {
		return nil
	}
	_, res, _, err := s.decide(ctx, method, nil)
	if err != nil {
		return err
	}
	if !res.Allowed {
		_ = grpc.SetTrailer(ctx, s.deniedMetadata(&res))
		return s.deniedStatus(ctx, res)
	}
	if md := s.allowedMetadata(&res); md != nil {
		_ = grpc.SetHeader(ctx, md)
	}
	return nil
}
