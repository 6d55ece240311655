package tollgate

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
)

// Option configures a Limiter (New), a RedisStore (NewRedisStore) or a
// MemoryStore (NewMemoryStore): each option's comment names the
// constructor that takes it. An option given to another constructor is a
// wiring mistake, which New reports as ErrInvalidOption.
type Option struct {
	name  string // the option's function, for errors
	taker taker  // the constructor that takes it
	apply func(*config)
}

// taker names the constructor an Option is for.
type taker uint8

const (
	takerNew taker = iota
	takerRedisStore
	takerMemoryStore
)

// String returns the constructor's name, as an error names it.
func (t taker) String() string {
	return [...]string{"New", "NewRedisStore", "NewMemoryStore"}[t]
}

// applyOptions applies to c the options opts for the constructor t, and
// returns the wiring mistake of the first option that is for another.
func applyOptions(c *config, t taker, opts []Option) error {
	for _, o := range opts {
		if o.apply == nil {
			return fmt.Errorf("%w: the zero Option", ErrInvalidOption)
		}
		if o.taker != t {
			return fmt.Errorf("%w: %s is an option of %s, not of %s", ErrInvalidOption, o.name, o.taker, t)
		}
		o.apply(c)
	}
	return nil
}

// config collects the options of New.
type config struct {
	policy     breaker.FailurePolicy
	fallback   Store
	breaker    breaker.Settings
	log        *slog.Logger
	denialKeys *int // nil: the default
	holdTTL    time.Duration
	leaseTTL   time.Duration
	permitTTL  time.Duration
	resolver   planResolver
	shadow     bool
	fleet      *time.Duration // the heartbeat's interval; nil: no fleet

	keyPrefix string // NewRedisStore's
	unbatched bool   // NewRedisStore's
	maxKeys   int    // NewMemoryStore's
}

// validate checks the options, as New takes them.
func (c *config) validate() error {
	switch {
	case !c.breaker.Valid():
		return fmt.Errorf("%w: breaker settings out of range", ErrInvalidOption)
	case c.policy < breaker.Fallback || c.policy > breaker.FailClosed:
		return fmt.Errorf("%w: unknown failure policy %d", ErrInvalidOption, c.policy)
	case c.holdTTL < time.Millisecond || c.holdTTL > maxRefillPeriod:
		return fmt.Errorf("%w: hold TTL %v is outside 1ms to 100 years", ErrInvalidOption, c.holdTTL)
	case c.leaseTTL < time.Millisecond || c.leaseTTL > maxLeaseTTL:
		return fmt.Errorf("%w: lease TTL %v is outside 1ms to 1m", ErrInvalidOption, c.leaseTTL)
	case c.permitTTL < minPermitLease || c.permitTTL > maxPermitLease:
		return fmt.Errorf("%w: permit lease %v is outside %v to %v", ErrInvalidOption, c.permitTTL, minPermitLease, maxPermitLease)
	case c.fallback != nil && c.policy != breaker.Fallback:
		return fmt.Errorf("%w: WithFallback needs the Fallback failure policy, not %v", ErrInvalidOption, c.policy)
	case c.fleet != nil && c.policy != breaker.Fallback:
		return fmt.Errorf("%w: WithFleet needs the Fallback failure policy, not %v", ErrInvalidOption, c.policy)
	case c.log.Handler() == nil:
		return fmt.Errorf("%w: WithLogger: a Logger without a Handler (make one with slog.New)", ErrInvalidOption)
	}
	if err := wiringError(c.fallback); err != nil {
		return fmt.Errorf("fallback store: %w", err)
	}
	return nil
}

// defaultDenialCacheKeys is the default bound of WithDenialCache.
const defaultDenialCacheKeys = 10_000

// WithFailurePolicy sets what a Limiter does while its store fails. The
// default is Fallback.
func WithFailurePolicy(p breaker.FailurePolicy) Option {
	return Option{name: "WithFailurePolicy", taker: takerNew, apply: func(c *config) { c.policy = p }}
}

// WithFallback sets the store that decides under the Fallback policy;
// under another policy it is ErrInvalidOption. The default is a
// NewMemoryStore().
func WithFallback(s Store) Option {
	return Option{name: "WithFallback", taker: takerNew, apply: func(c *config) { c.fallback = s }}
}

// WithBreaker configures the circuit breaker in front of the store. The
// default is breaker.Settings{}: 3 failures in a row open it for 500ms. A
// MemoryStore, which cannot fail, gets no breaker.
func WithBreaker(s breaker.Settings) Option {
	return Option{name: "WithBreaker", taker: takerNew, apply: func(c *config) { c.breaker = s }}
}

// WithLogger sets where a Limiter reports outages: one warning when the
// store starts failing, one info line with the duration when it recovers.
// If the logger has the debug level enabled when New runs, every decision
// is also logged at debug level (plan, outcome, source; never the key).
// nil discards everything; a Logger without a Handler (&slog.Logger{}) is
// ErrInvalidOption. The default is slog.Default().
func WithLogger(log *slog.Logger) Option {
	return Option{name: "WithLogger", taker: takerNew, apply: func(c *config) {
		if log == nil {
			log = slog.New(slog.DiscardHandler)
		}
		c.log = log
	}}
}

// WithDenialCache bounds the keys whose denials the Limiter remembers, and
// 0 turns the cache off. A remembered denial answers the same request (key,
// plans and cost) without the store, with Source SourceCache, until the
// RetryAfter the store gave has passed; before then the store would deny it
// too, so the cache never admits and never denies what the store would
// admit, except after a Reset by another instance, which is seen once that
// RetryAfter has passed. A key under attack then costs the store about one
// call per refill, not one per request. The default is 10,000 keys, or 0
// when the store is a MemoryStore, which is as fast as the cache.
func WithDenialCache(keys int) Option {
	return Option{name: "WithDenialCache", taker: takerNew, apply: func(c *config) { c.denialKeys = &keys }}
}

// WithHoldTTL sets how long a reservation's hold lives (Reserve): a Settle
// after it refunds nothing, and charges only the tokens used beyond the
// reservation (ErrHoldExpired). In Redis a settled hold leaves a tombstone
// for as long again, so that a retried Settle changes nothing. A Reset on a
// RedisStore or a MemoryStore voids the refunds of the holds taken before
// it by every Limiter that shares the store, for the resetting Limiter's
// hold TTL, or 15 minutes if that is longer: give the Limiters that share
// a store the same one. It must be 1ms to
// 100 years. The default is 15 minutes.
func WithHoldTTL(d time.Duration) Option {
	return Option{name: "WithHoldTTL", taker: takerNew, apply: func(c *config) { c.holdTTL = d }}
}

// WithLeaseTTL sets how long a lease of a plan with Plan.Lease lives: it
// serves decisions for this long, up to half as long again (a sweeper
// checks every half TTL), and its unused rest goes back to Redis within
// another half TTL, so that other instances never wait long for tokens
// this one took and does not need. A lease's hold
// in Redis lives 4 lease TTLs, whatever WithHoldTTL says. It must be 1ms
// to 1 minute. The default is 1 second.
func WithLeaseTTL(d time.Duration) Option {
	return Option{name: "WithLeaseTTL", taker: takerNew, apply: func(c *config) { c.leaseTTL = d }}
}

// WithPermitLease sets how long a permit of a concurrency plan lives
// without a renewal (Acquire): the Limiter renews the permits it holds
// every third of it, so a holder that dies gives its permits back within
// this long plus a third, and never before this long. It must be 30ms to
// 1 hour. The default is 5 seconds.
func WithPermitLease(d time.Duration) Option {
	return Option{name: "WithPermitLease", taker: takerNew, apply: func(c *config) { c.permitTTL = d }}
}

// WithShadow puts every plan of the Limiter in dry run, as Plan.Shadow
// puts one: decisions take tokens exactly as if enforced, and report what
// enforcement would have denied (Result.ShadowDenied, PlanStats
// .ShadowDenied), but every request is allowed. It also shadows the plans
// of SetPlans, a plan resolver (WithPlanResolver) and AllowPlans. Failure policies apply as
// usual: under FailClosed an outage is still an error. The default
// enforces the plans as they say.
func WithShadow() Option {
	return Option{name: "WithShadow", taker: takerNew, apply: func(c *config) { c.shadow = true }}
}

// WithPlanResolver has r choose, per key, the plans that the plan names of
// a call stand for (Allow, AllowN, Peek, PeekN, Wait, Reserve, Acquire;
// not AllowPlans, whose caller holds its plans): for example the plan of
// the key's customer tier, looked up in a cache. r is given the plan p
// the call named, as New or SetPlans gave it, and returns p unchanged for
// no override. It must
// keep p.Name, which names the bucket: a key that changes tier keeps its
// bucket, its tokens kept on an upgrade and clamped to the new Capacity
// on a downgrade. r runs on every decision, once per plan asked, after
// the key is checked and before the store: it must be fast and safe for
// concurrent use. What r answers:
//
//   - a valid plan of the same name: it decides, in the bucket of that
//     name. Its Shadow flag applies as it returns it (WithShadow still
//     shadows every plan).
//   - an invalid plan, one of another name, or one of the other kind (a
//     concurrency plan for a name that is not one, or the reverse): the
//     call returns ErrInvalidPlan.
//   - an error wrapping ErrExempt: the plan is left out of the decision.
//     When every plan is, the decision is allowed without the store, with
//     Source SourceExempt, and Stats does not count it; a cost below 1
//     and a context that has ended still get their errors. An Acquire
//     exempt from every concurrency plan it names takes the tokens of
//     the plans left, and its Permit holds no permit.
//   - any other error, or a panic: the call returns ErrResolver, wrapping
//     r's error (never a panic's value, which may quote the key), under
//     every failure policy.
//
// r is given the key the caller meant (see ResolveAs): behind httplimit's
// and grpclimit's KeyFuncs, the value without its kind, such as the API
// key within "header:X-Api-Key:key-gold"; else the key decided.
//
// The Limiter keeps up to 16 distinct plans per name that r returned,
// validated and fingerprinted once, so a resolver that returns cached
// plans adds no allocation. The default is no resolver.
func WithPlanResolver(r func(ctx context.Context, key string, p Plan) (Plan, error)) Option {
	return Option{name: "WithPlanResolver", taker: takerNew, apply: func(c *config) { c.resolver = r }}
}

// WithFleet makes the fallback of a Limiter on a RedisStore enforce this
// instance's share of each plan during an outage, so that a fleet of N
// instances admits about one plan's worth, not N. While Redis answers,
// each instance records a heartbeat every interval (one script call from
// a goroutine of its own, which Close stops, never from a decision) and
// reads how many instances are alive: those whose last heartbeat is at
// most 3 of their own intervals old, so instances may use different
// intervals (one that stopped counts until 3 of this instance's
// intervals have passed too). While the store fails, the Fallback
// policy's store decides on each plan with its Capacity and Rate divided
// by the count last read (a window plan's Capacity), the Capacity never
// below the cost of the decision, nor the Rate below Capacity per 100
// years.
//
// The fleet is the instances with the same Redis and key prefix. The
// bound assumes the load balancer spreads each key's requests evenly;
// an instance that gets more than its share is denied sooner, one that
// gets less admits less (docs/outages.md). Until the first
// heartbeat succeeds, and without WithFleet, an instance counts itself
// alone and its fallback enforces the whole plan. The interval is 5s
// when 0, and at least 10ms; it is an ErrInvalidOption on any store but
// a RedisStore, under a failure policy but Fallback, or below 10ms. The
// default is no fleet: no goroutine, no heartbeat.
func WithFleet(interval time.Duration) Option {
	return Option{name: "WithFleet", taker: takerNew, apply: func(c *config) { c.fleet = &interval }}
}

// WithoutBatching makes a RedisStore send every decision in a script
// call of its own. By default, on a standalone Redis or Sentinel, a
// decision that finds a call slot free (fewer calls under way than the
// client's pool size, and at most 16) is sent at once, alone; decisions
// that arrive while every slot is taken wait, and the next call decides
// up to 32 of them, each independently, all or nothing, as a call of its
// own would, all at one read of Redis TIME, when the batch began. Each
// caller's context bounds its own wait; a batch is bounded by the latest deadline among its
// callers, so that one caller's cancellation or deadline fails no other
// decision. Only a *redis.Client, or a client that embeds one, batches: a
// ClusterClient or Ring never does, nor does a client whose servers the
// store cannot tell, such as an auto-pipeliner, which may be a Cluster's:
// the keys of different callers lie in different slots, which one script
// call cannot span. It is an option of NewRedisStore.
func WithoutBatching() Option {
	return Option{name: "WithoutBatching", taker: takerRedisStore, apply: func(c *config) { c.unbatched = true }}
}

// WithKeyPrefix sets the first part of every Redis key; instances share
// buckets only when they share it. It must not contain '{' or '}', which
// would move the Cluster hash tag. It is an option of NewRedisStore. The
// default is "tollgate".
func WithKeyPrefix(prefix string) Option {
	return Option{name: "WithKeyPrefix", taker: takerRedisStore, apply: func(c *config) { c.keyPrefix = prefix }}
}

// WithMaxKeys bounds the keys a MemoryStore holds. Values below 1 mean the
// default, 100,000 keys. It is an option of NewMemoryStore.
func WithMaxKeys(n int) Option {
	return Option{name: "WithMaxKeys", taker: takerMemoryStore, apply: func(c *config) { c.maxKeys = n }}
}
