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
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/callerkey"
	"github.com/tollgate-go/tollgate/internal/isnil"
	"github.com/tollgate-go/tollgate/internal/ratefields"
)

// Waiter waits for tokens. *tollgate.Limiter implements it (see
// tollgate.Limiter.Wait). The client interceptors and the Pace mode of
// WithStreamMessages need one.
type Waiter interface {
	Wait(ctx context.Context, key string, cost int64, plans ...string) (tollgate.Result, error)
}

// Option configures the server interceptors and NewMiddlewareLimiter.
type Option func(*server)

// WithPlans names the plans each call takes its tokens from: from all of
// them, or, if one lacks the tokens, from none. A concurrency plan among
// them (tollgate.Plan.Concurrency) gives the call a permit to hold while
// its handler runs (see Acquirer), as it does in WithMethodPlans. A later
// WithPlans replaces an earlier one. The default, or no names, is the
// RateLimiter's default plan (for a *tollgate.Limiter, the first plan
// given to New), which must not be a concurrency plan (the interceptors
// panic): name that one. The methods that WithMethodPlans does not name
// take from it too.
func WithPlans(names ...string) Option {
	names = slices.Clone(names)
	return func(s *server) { s.plans = chain{names: names} }
}

// WithMethodPlans gives methods plan chains of their own, in place of the
// plans of WithPlans. A key of methods is a full method name,
// "/package.Service/Method", or a service's prefix, "/package.Service/",
// for all of its methods; a full name wins over its service's prefix. Each
// chain must name at least one plan: to exempt a method, use WithSkip. A
// later WithMethodPlans replaces an earlier one. The default is none.
//
// The methods share the key's buckets of a plan they share: give methods
// buckets of their own with PerMethod, or with plans of their own.
func WithMethodPlans(methods map[string][]string) Option {
	m := make(map[string]chain, len(methods))
	for k, v := range methods {
		m[k] = chain{names: slices.Clone(v)}
	}
	return func(s *server) { s.methodPlans = m }
}

// WithCost sets the tokens a call takes to cost(ctx, fullMethod, req),
// which must be at least 1 and at most the Capacity of each plan. req is
// the request of a unary call, and nil when a stream opens. A cost
// outside that range is a bug in cost, answered codes.Internal (see
// WithErrorStatus). The default, or a nil cost, takes 1 token per call.
func WithCost(cost func(ctx context.Context, fullMethod string, req any) int64) Option {
	return func(s *server) { s.cost = cost }
}

// WithSkip exempts the calls for which skip returns true, such as health
// checks: they go on to the handler without a key, without taking a
// token and without rate limit metadata. The default, or a nil skip,
// exempts none.
func WithSkip(skip func(ctx context.Context, fullMethod string) bool) Option {
	return func(s *server) { s.skip = skip }
}

// MetadataMode selects the rate limit fields that the server interceptors
// send with a decision. The values are those httplimit writes as header
// fields (see httplimit.HeaderMode), under lower-case names: after the
// third call within a second of a key to a plan gold with Capacity 2 and
// Rate 1,
//
//	ratelimit-policy: "gold";q=2;w=2
//	ratelimit: "gold";r=0;t=1
//	retry-after: 1
//	grpc-retry-pushback-ms: 999
//
// A denied call gets them in its trailer, with retry-after (seconds,
// rounded up, at least 1) in every mode and grpc-retry-pushback-ms unless
// WithPushback(false): the call ends with a trailers-only response, which
// grpc-go needs to retry it. An allowed call gets the fields in its
// response header only with WithAllowedMetadata.
//
// A concurrency plan is described as httplimit describes it: q is its
// capacity, r its free permits, and there is no w or t; when it binds,
// there is no x-ratelimit-reset, retry-after or grpc-retry-pushback-ms.
type MetadataMode int

const (
	// MetadataIETF sends ratelimit-policy and ratelimit. It is the
	// default.
	MetadataIETF MetadataMode = iota
	// MetadataBoth sends the IETF fields and the legacy ones,
	// x-ratelimit-limit, x-ratelimit-remaining and x-ratelimit-reset.
	MetadataBoth
	// MetadataNone sends no rate limit fields. Denials still get
	// retry-after.
	MetadataNone
)

// WithMetadata selects the rate limit fields sent with decisions. The
// default is MetadataIETF.
func WithMetadata(mode MetadataMode) Option {
	return func(s *server) { s.metadata = mode }
}

// WithAllowedMetadata selects whether allowed calls get the rate limit
// fields of WithMetadata in their response header, set before the handler
// runs, so that a handler's own header metadata joins them. gRPC clients
// seldom read the header of a call that succeeded, and metadata is a map
// that grpc-go copies again when it is set, which costs a call several
// allocations and far more time than the interceptor's own work, which
// allocates nothing. The default is false.
func WithAllowedMetadata(on bool) Option {
	return func(s *server) { s.allowedMD = on }
}

// WithPushback selects whether a denial's trailer carries
// grpc-retry-pushback-ms, the time until the call would pass in
// milliseconds, rounded up (gRFC A6). A grpc-go client whose retry policy
// lists RESOURCE_EXHAUSTED then retries after that time rather than after
// its own backoff; a client whose policy does not list it does not retry.
// The default is true.
func WithPushback(on bool) Option {
	return func(s *server) { s.pushback = on }
}

// MessageMode says what a stream does with a message that finds no
// tokens; see WithStreamMessages.
type MessageMode int

const (
	// Pace waits for the tokens before the handler gets the message. The
	// handler reads no further while it waits, so HTTP/2 flow control
	// holds the client back once the stream's window fills: the stream
	// slows to the plan's rate and goes on. A wait that cannot end
	// before the stream's deadline ends the stream at once with
	// codes.ResourceExhausted.
	Pace MessageMode = iota + 1
	// Reject fails the handler's RecvMsg with codes.ResourceExhausted. A
	// gRPC stream cannot refuse one message and go on: a handler returns
	// the error, and that ends the stream, so the client loses the
	// stream, not the message. Use it where a client that sends too fast
	// is misbehaving.
	Reject
)

// WithStreamMessages limits every message that a stream's handler
// receives, not just the stream's opening: each takes cost(m) tokens, or 1
// for a nil cost, from plans, or from the stream's plans if none are
// named, for the key the stream was opened with. The opening is still
// limited as without this option. A message holds no permit: plans must
// not name a concurrency plan, and must be given if a chain of the
// interceptor does.
//
// In Pace mode, the RateLimiter given to StreamServerInterceptor must be
// a Waiter, as *tollgate.Limiter is. The default is no per-message limit.
func WithStreamMessages(mode MessageMode, cost func(m any) int64, plans ...string) Option {
	plans = slices.Clone(plans)
	return func(s *server) {
		s.msgMode, s.msgCost, s.msgPlans = mode, cost, plans
	}
}

// WithDeniedStatus sets the status that ends a denied call, res being the
// decision; the rate limit metadata is set when it runs. The default, or
// a nil denied, or denied returning nil, is DeniedStatus(res, l), l being
// the RateLimiter if it is a Planner.
func WithDeniedStatus(denied func(ctx context.Context, res tollgate.Result) *status.Status) Option {
	return func(s *server) { s.denied = denied }
}

// WithErrorStatus sets the status that ends a call the RateLimiter could
// not decide, err being the KeyFunc's error (which wraps ErrNoKey for the
// KeyFuncs of this package) or the RateLimiter's. It is the place to log
// err, which never holds a key when it comes from this package or from
// tollgate, though it may from a KeyFunc of your own. The default, or a
// nil h, or h returning nil, is ErrorStatus(ctx, err).
func WithErrorStatus(h func(ctx context.Context, err error) *status.Status) Option {
	return func(s *server) { s.onError = h }
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
		m.fail("unknown MessageMode %d", s.msgMode)
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

// limitedStream limits the messages a stream's handler receives.
type limitedStream struct {
	grpc.ServerStream
	s     *server
	key   string
	plans []string
	ctx   context.Context // the stream's, naming the key's caller's key (callerkey)
}

// RecvMsg receives a message, then takes its tokens before the handler
// sees it: pacing holds the message, and with it the stream's reads.
func (ls *limitedStream) RecvMsg(m any) error {
	if err := ls.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	s, ctx := ls.s, ls.ctx
	cost := int64(1)
	if s.msgCost != nil {
		cost = s.msgCost(m)
	}
	var res tollgate.Result
	var err error
	if s.msgMode == Pace {
		res, err = s.waiter.Wait(ctx, ls.key, cost, ls.plans...)
		if errors.Is(err, tollgate.ErrWaitExceedsDeadline) {
			res.Allowed, err = false, nil
		}
	} else {
		res, err = s.lim.AllowN(ctx, ls.key, cost, ls.plans...)
	}
	if err != nil {
		return s.errorStatus(ctx, err)
	}
	if !res.Allowed {
		ls.SetTrailer(s.deniedMetadata(&res))
		return s.deniedStatus(ctx, res)
	}
	return nil
}

// allowedMetadata returns the header metadata of an allowed call, or nil.
func (s *server) allowedMetadata(res *tollgate.Result) metadata.MD {
	if !s.allowedMD || s.metadata == MetadataNone {
		return nil
	}
	var f fields
	f.buf = f.arr[:0]
	s.appendFields(&f, res)
	return f.md()
}

// deniedMetadata returns the trailer metadata of a denied call.
func (s *server) deniedMetadata(res *tollgate.Result) metadata.MD {
	var f fields
	f.buf = f.arr[:0]
	if s.metadata != MetadataNone {
		s.appendFields(&f, res)
	}
	if ratefields.Concurrent(res, s.planner) {
		return f.md() // a permit comes back on no schedule: no time to tell
	}
	f.buf = ratefields.AppendRetryAfter(f.buf, res)
	f.end(mdRetryAfter)
	if s.pushback {
		f.buf = strconv.AppendInt(f.buf, retryDelay(res.RetryAfter).Milliseconds(), 10)
		f.end(mdPushback)
	}
	return f.md()
}

func (s *server) appendFields(f *fields, res *tollgate.Result) {
	f.buf = ratefields.AppendPolicy(f.buf, res, s.planner, false)
	f.end(mdPolicy)
	f.buf = ratefields.AppendRateLimit(f.buf, res, s.planner, false)
	f.end(mdRateLimit)
	if s.metadata == MetadataBoth {
		f.buf = ratefields.AppendLimit(f.buf, res)
		f.end(mdLimit)
		f.buf = ratefields.AppendRemaining(f.buf, res)
		f.end(mdRemaining)
		if !ratefields.Concurrent(res, s.planner) {
			f.buf = ratefields.AppendReset(f.buf, res)
			f.end(mdReset)
		}
	}
}

// A metadata entry that the interceptors send.
type mdName uint8

const (
	mdPolicy mdName = iota
	mdRateLimit
	mdLimit
	mdRemaining
	mdReset
	mdRetryAfter
	mdPushback
	numMD
)

var mdNames = [numMD]string{
	mdPolicy:     "ratelimit-policy",
	mdRateLimit:  "ratelimit",
	mdLimit:      "x-ratelimit-limit",
	mdRemaining:  "x-ratelimit-remaining",
	mdReset:      "x-ratelimit-reset",
	mdRetryAfter: "retry-after",
	mdPushback:   "grpc-retry-pushback-ms",
}

// fields collects the values of a decision's metadata in one buffer, so
// that they cost one string, one []string and the map, not two
// allocations each.
type fields struct {
	arr  [256]byte
	buf  []byte
	ids  [numMD]mdName
	ends [numMD]int
	n    int
}

func (f *fields) end(id mdName) {
	f.ids[f.n], f.ends[f.n] = id, len(f.buf)
	f.n++
}

func (f *fields) md() metadata.MD {
	s := string(f.buf)
	values := make([]string, f.n)
	md := make(metadata.MD, f.n)
	start := 0
	for i := range f.n {
		values[i] = s[start:f.ends[i]]
		// Capacity 1, so that an append by someone else copies.
		md[mdNames[f.ids[i]]] = values[i : i+1 : i+1]
		start = f.ends[i]
	}
	return md
}
