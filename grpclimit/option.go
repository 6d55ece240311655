package grpclimit

import (
	"context"
	"slices"

	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
)

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
		s.msgMode, s.msgCost, s.msgPlans, s.msgGiven = mode, cost, plans, true
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
