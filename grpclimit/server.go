// Package grpclimit rate limits gRPC calls with a tollgate.RateLimiter:
// server interceptors that take tokens for each call (or each stream, or
// each message of a stream) from the buckets of the caller's key, and
// client interceptors that pace a program's own outbound calls.
//
// On a server, one line adds the limit:
//
//	srv := grpc.NewServer(
//		grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, grpclimit.ByPeerIP(), grpclimit.WithPlans("gold"))),
//		grpc.ChainStreamInterceptor(grpclimit.StreamServerInterceptor(lim, grpclimit.ByPeerIP(), grpclimit.WithPlans("gold"))),
//	)
//
// A denied call ends with codes.ResourceExhausted, whose status details
// carry an errdetails.RetryInfo (when to try again), a QuotaFailure and
// an ErrorInfo naming the plan, and whose trailer carries the IETF
// ratelimit and ratelimit-policy fields, retry-after, and
// grpc-retry-pushback-ms, which grpc-go's retry policies obey. A
// concurrency plan (tollgate.Plan.Concurrency) among the plans holds a
// permit for the length of the handler, or of the stream, and its denial
// tells no time to try again (see Acquirer). Allowed calls can get the
// IETF fields in their header (WithAllowedMetadata). A
// store outage under tollgate.FailClosed ends a call with
// codes.Unavailable, not ResourceExhausted, so clients do not back off
// from a healthy server for the wrong reason. Keys, which may be personal
// data, never appear in any message, detail or metadata. A
// plan resolver (tollgate.WithPlanResolver) is given the key the caller sent, such as the API
// key within "md:x-api-key:key-gold" (see KeyFunc).
//
// On a client, UnaryClientInterceptor and StreamClientInterceptor wait
// for a token before each call, within the call's deadline:
//
//	conn, err := grpc.NewClient(target,
//		grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(lim, grpclimit.Key("upstream:billing"))))
//
// This package is a module of its own, so that the tollgate module never
// requires grpc. Everything in it is safe for concurrent use.
package grpclimit

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/callerkey"
	"github.com/tollgate-go/tollgate/internal/isnil"
)

// Waiter waits for tokens. *tollgate.Limiter implements it (see
// tollgate.Limiter.Wait). The client interceptors and the Pace mode of
// WithStreamMessages need one.
type Waiter interface {
	Wait(ctx context.Context, key string, cost int64, plans ...string) (tollgate.Result, error)
}

// server is the configuration the server interceptors share.
type server struct {
	lim         tollgate.RateLimiter
	planner     Planner  // lim, if it describes its plans; else nil
	waiter      Waiter   // lim, if it waits; else nil
	acquirer    Acquirer // lim, if it holds permits; else nil
	key         KeyFunc
	plans       chain
	methodPlans map[string]chain

	cost      func(context.Context, string, any) int64
	skip      func(context.Context, string) bool
	metadata  MetadataMode
	allowedMD bool
	pushback  bool
	denied    func(context.Context, tollgate.Result) *status.Status
	onError   func(context.Context, error) *status.Status

	releaseError func(ctx context.Context, fullMethod string, err error)

	msgMode  MessageMode // 0: no per-message limit
	msgGiven bool        // WithStreamMessages was given, whose mode may not be 0
	msgCost  func(any) int64
	msgPlans []string
}

// newServer checks the configuration, and panics on a wiring mistake:
// the interceptors' constructors have no error result,
// since they are written inside grpc.NewServer's arguments.
func newServer(caller string, l tollgate.RateLimiter, key KeyFunc, opts []Option) *server {
	if isnil.Value(l) || key == nil {
		panic("grpclimit: " + caller + ": nil RateLimiter or KeyFunc")
	}
	s := &server{lim: l, key: key, pushback: true, releaseError: logReleaseError}
	s.planner, _ = l.(Planner)
	s.waiter, _ = l.(Waiter)
	s.acquirer, _ = l.(Acquirer)
	for _, o := range opts {
		o(s)
	}
	m := misuse(caller)
	s.checkPlans(m, "", &s.plans)
	if name, ok := defaultPermits(l, s.plans.names); ok {
		m.fail("the default plan %q is a concurrency plan: name it in WithPlans", name)
	}
	for method, c := range s.methodPlans {
		if !strings.HasPrefix(method, "/") || strings.Count(method, "/") != 2 {
			m.fail("WithMethodPlans: %q is neither \"/package.Service/Method\" nor \"/package.Service/\"", method)
		}
		if len(c.names) == 0 {
			m.fail("WithMethodPlans: no plans for %q; exempt a method with WithSkip", method)
		}
		s.checkPlans(m, "WithMethodPlans: "+method+": ", &c)
		s.methodPlans[method] = c
	}
	if len(s.methodPlans) == 0 {
		s.methodPlans = nil
	}
	if s.metadata < MetadataIETF || s.metadata > MetadataNone {
		m.fail("unknown MetadataMode %d", s.metadata)
	}
	s.checkMessages(m)
	return s
}

// misuse is the constructor a wiring mistake is reported from.
type misuse string

// fail panics with the mistake, named after the constructor.
func (m misuse) fail(format string, args ...any) {
	panic("grpclimit: " + string(m) + ": " + fmt.Sprintf(format, args...))
}

// checkPlans checks the names of c, what says where they were given, and
// finds whether one is a concurrency plan.
func (s *server) checkPlans(m misuse, what string, c *chain) {
	for i, name := range c.names {
		if slices.Contains(c.names[:i], name) {
			m.fail("%splan %q named twice", what, name)
		}
		if s.planner != nil {
			plan, ok := s.planner.Plan(name)
			if !ok {
				m.fail("%sunknown plan %q", what, name)
			}
			c.permits = c.permits || plan.Concurrency
		}
	}
	if c.permits && s.acquirer == nil {
		m.fail("%sa concurrency plan needs a RateLimiter that is an Acquirer", what)
	}
}

// checkMessages checks the options of WithStreamMessages.
func (s *server) checkMessages(m misuse) {
	switch s.msgMode {
	case 0:
		if s.msgGiven {
			m.fail("WithStreamMessages: unknown MessageMode 0")
		}
	case Pace:
		if s.waiter == nil {
			m.fail("WithStreamMessages(Pace): the RateLimiter has no Wait method")
		}
		fallthrough
	case Reject:
		msgs := chain{names: s.msgPlans}
		s.checkPlans(m, "WithStreamMessages: ", &msgs)
		if msgs.permits || len(msgs.names) == 0 && s.holdsPermits() {
			m.fail("WithStreamMessages: a message holds no permit: name its plans, and no concurrency plan")
		}
	default:
		m.fail("WithStreamMessages: unknown MessageMode %d", s.msgMode)
	}
}

// plansFor returns the plans of a method.
func (s *server) plansFor(fullMethod string) chain {
	if s.methodPlans == nil {
		return s.plans
	}
	if p, ok := s.methodPlans[fullMethod]; ok {
		return p
	}
	if i := strings.LastIndexByte(fullMethod, '/'); i > 0 {
		if p, ok := s.methodPlans[fullMethod[:i+1]]; ok {
			return p
		}
	}
	return s.plans
}

// UnaryServerInterceptor returns a server interceptor that rate limits
// unary calls: each takes a token (see WithCost) from the buckets of the
// plans (see WithPlans and WithMethodPlans) for the key that key returns,
// from all of them or from none, as AllowN does.
//
//	grpc.NewServer(grpc.ChainUnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, grpclimit.ByPeerIP())))
//
// An allowed call goes on to the handler, with the rate limit fields in
// its response header if WithAllowedMetadata asks. A denied call ends with
// DeniedStatus: codes.ResourceExhausted and its details, and the fields in
// the trailer (see MetadataMode). A call that could not be decided ends
// as ErrorStatus describes: InvalidArgument without a usable key,
// Unavailable for a store outage under tollgate.FailClosed, the caller's
// ended context with its own code. The options change these answers.
//
// It panics if l (also a typed nil) or key is nil, if a plan is named twice, if an option is
// invalid, or if l describes its plans, as *tollgate.Limiter does, and a
// plan is not among them, or one is a concurrency plan and l is not an
// Acquirer, or, without WithPlans, l's default plan is a concurrency
// plan: these are wiring mistakes, caught when the program starts.
// Serving never panics.
func UnaryServerInterceptor(l tollgate.RateLimiter, key KeyFunc, opts ...Option) grpc.UnaryServerInterceptor {
	s := newServer("UnaryServerInterceptor", l, key, opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if s.skip != nil && s.skip(ctx, info.FullMethod) {
			return handler(ctx, req)
		}
		_, res, p, err := s.decide(ctx, info.FullMethod, req)
		if err != nil {
			return nil, err
		}
		if !res.Allowed {
			_ = grpc.SetTrailer(ctx, s.deniedMetadata(&res))
			return nil, s.deniedStatus(ctx, res)
		}
		if md := s.allowedMetadata(&res); md != nil {
			// Fails only when ctx is not a server call's, as in a test
			// that calls the interceptor itself.
			_ = grpc.SetHeader(ctx, md)
		}
		if p != nil {
			defer s.release(ctx, info.FullMethod, p)
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor returns a server interceptor that rate limits
// streams: each takes a token (see WithCost, which is given a nil
// request) from the buckets of the plans for the key that key returns
// when it opens, and, with WithStreamMessages, more for each message the
// handler receives. The answers are those of UnaryServerInterceptor; with
// WithAllowedMetadata, an allowed stream gets the rate limit fields in its
// response header, which gRPC sends with the first message or when the
// handler calls SendHeader. A denied stream ends at once.
//
// It panics on the wiring mistakes UnaryServerInterceptor panics on, and
// if WithStreamMessages asks to Pace and l is not a Waiter.
func StreamServerInterceptor(l tollgate.RateLimiter, key KeyFunc, opts ...Option) grpc.StreamServerInterceptor {
	s := newServer("StreamServerInterceptor", l, key, opts)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := ss.Context()
		if s.skip != nil && s.skip(ctx, info.FullMethod) {
			return handler(srv, ss)
		}
		k, res, p, err := s.decide(ctx, info.FullMethod, nil)
		if err != nil {
			return err
		}
		if !res.Allowed {
			ss.SetTrailer(s.deniedMetadata(&res))
			return s.deniedStatus(ctx, res)
		}
		if md := s.allowedMetadata(&res); md != nil {
			_ = ss.SetHeader(md)
		}
		if s.msgMode != 0 {
			plans := s.msgPlans
			if len(plans) == 0 {
				plans = s.plansFor(info.FullMethod).names
			}
			ss = &limitedStream{ServerStream: ss, s: s, key: k, plans: plans, ctx: callerkey.Context(ctx, k)}
		}
		if p != nil {
			defer s.release(ctx, info.FullMethod, p)
		}
		return handler(srv, ss)
	}
}

// decide finds the call's key and takes its tokens, or, for a chain with
// a concurrency plan, acquires its permits with them. It returns the key,
// the decision, the permit the call holds until its handler returns (nil
// if none), and an error that is a status, for a call to end with.
func (s *server) decide(ctx context.Context, fullMethod string, req any) (string, tollgate.Result, *tollgate.Permit, error) {
	key, err := s.key(ctx, fullMethod)
	if err != nil {
		return "", tollgate.Result{}, nil, s.errorStatus(ctx, err)
	}
	cost := int64(1)
	if s.cost != nil {
		cost = s.cost(ctx, fullMethod, req)
	}
	c := s.plansFor(fullMethod)
	var res tollgate.Result
	var p *tollgate.Permit
	// A plan resolver sees the API key, not the bucket's key.
	if c.permits {
		if p, err = s.acquirer.Acquire(callerkey.Context(ctx, key), key, cost, c.names...); err == nil {
			res = p.Result()
		}
	} else {
		res, err = s.lim.AllowN(callerkey.Context(ctx, key), key, cost, c.names...)
	}
	if err != nil {
		return "", res, nil, s.errorStatus(ctx, err)
	}
	if !res.Allowed {
		p = nil // it holds nothing
	}
	return key, res, p, nil
}

func (s *server) deniedStatus(ctx context.Context, res tollgate.Result) error {
	if s.denied != nil {
		if st := s.denied(ctx, res); st != nil {
			return st.Err()
		}
	}
	return DeniedStatus(res, s.planner).Err()
}

func (s *server) errorStatus(ctx context.Context, err error) error {
	if s.onError != nil {
		if st := s.onError(ctx, err); st != nil {
			return st.Err()
		}
	}
	return ErrorStatus(ctx, err).Err()
}
