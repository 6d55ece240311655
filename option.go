package tollgate

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
)

// FailurePolicy says how a Limiter decides while its store fails. It is
// breaker.FailurePolicy, so that a Limiter and a shared circuit breaker
// speak of failures with the same values.
type FailurePolicy = breaker.FailurePolicy

const (
	// Fallback lets a local fallback store decide (Source SourceFallback):
	// each instance then enforces the plans on its own, so the whole fleet
	// may admit up to one plan's worth per instance. It is the default.
	Fallback = breaker.Fallback
	// FailOpen allows every request (Source SourceFailOpen).
	FailOpen = breaker.FailOpen
	// FailClosed returns ErrStoreUnavailable.
	FailClosed = breaker.FailClosed
)

// Option configures a Limiter.
type Option func(*config)

// config collects the options of New.
type config struct {
	policy     FailurePolicy
	fallback   Store
	breaker    breaker.Settings
	log        *slog.Logger
	denialKeys *int // nil: the default
	holdTTL    time.Duration
	leaseTTL   time.Duration
	resolver   PlanResolver
	shadow     bool
	fleet      *FleetSettings // nil: no fleet
}

// validate checks the options, as New takes them.
func (c *config) validate() error {
	switch {
	case !c.breaker.Valid():
		return fmt.Errorf("%w: breaker settings out of range", ErrInvalidOption)
	case c.policy < Fallback || c.policy > FailClosed:
		return fmt.Errorf("%w: unknown failure policy %d", ErrInvalidOption, c.policy)
	case c.holdTTL < time.Millisecond || c.holdTTL > maxRefillPeriod:
		return fmt.Errorf("%w: hold TTL %v is outside 1ms to 100 years", ErrInvalidOption, c.holdTTL)
	case c.leaseTTL < time.Millisecond || c.leaseTTL > maxLeaseTTL:
		return fmt.Errorf("%w: lease TTL %v is outside 1ms to 1m", ErrInvalidOption, c.leaseTTL)
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
func WithFailurePolicy(p FailurePolicy) Option {
	return func(c *config) { c.policy = p }
}

// WithFallback sets the store that decides under the Fallback policy. The
// default is a NewMemoryStore().
func WithFallback(s Store) Option {
	return func(c *config) { c.fallback = s }
}

// WithBreaker configures the circuit breaker in front of the store. The
// default is breaker.Settings{}: 3 failures in a row open it for 500ms. A
// MemoryStore, which cannot fail, gets no breaker.
func WithBreaker(s breaker.Settings) Option {
	return func(c *config) { c.breaker = s }
}

// WithLogger sets where a Limiter reports outages: one warning when the
// store starts failing, one info line with the duration when it recovers.
// If the logger has the debug level enabled when New runs, every decision
// is also logged at debug level (plan, outcome, source; never the key).
// nil discards everything. The default is slog.Default().
func WithLogger(log *slog.Logger) Option {
	return func(c *config) {
		if log == nil {
			log = slog.New(slog.DiscardHandler)
		}
		c.log = log
	}
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
	return func(c *config) { c.denialKeys = &keys }
}

// WithHoldTTL sets how long a reservation's hold lives (Reserve): a Settle
// after it refunds nothing, and charges only the tokens used beyond the
// reservation (ErrHoldExpired). In Redis a settled hold leaves a tombstone
// for as long again, so that a retried Settle changes nothing. It must be
// 1ms to maxRefillPeriod. The default is 15 minutes.
func WithHoldTTL(d time.Duration) Option {
	return func(c *config) { c.holdTTL = d }
}

// WithLeaseTTL sets how long a lease of a plan with Plan.Lease lives: it
// serves decisions for this long, up to half as long again (a sweeper
// checks every half TTL), and its unused rest goes back to Redis within
// another half TTL, so that other instances never wait long for tokens
// this one took and does not need. A lease's hold
// in Redis lives 4 lease TTLs, whatever WithHoldTTL says. It must be 1ms
// to 1 minute. The default is 1 second.
func WithLeaseTTL(d time.Duration) Option {
	return func(c *config) { c.leaseTTL = d }
}
