package tollgate

import (
	"fmt"
	"math"
	"time"
)

// MaxKeyLen is the longest key, in bytes, that a Limiter or Store accepts.
const MaxKeyLen = 1024

// maxCapacity is the largest Plan.Capacity: 2^53 micro-tokens, the largest
// whole number a Lua number holds exactly.
const maxCapacity = (1 << 53) / microTokens

// MaxRefillPeriod is the longest time a plan may take to refill an empty
// bucket (Capacity / Rate): 100 years, so that every wait fits a
// time.Duration and every TTL fits Redis.
const MaxRefillPeriod = 100 * 365 * 24 * time.Hour

// Plan is a named token bucket configuration. The zero value is not valid.
type Plan struct {
	// Name identifies the plan in calls and in Redis keys: 1 to 64 bytes
	// of [A-Za-z0-9_.-].
	Name string
	// Capacity is the bucket size, the largest burst, in tokens: 1 to
	// 9,007,199,254 (2^53 micro-tokens, the largest whole number a Lua
	// number holds exactly).
	Capacity int64
	// Rate is the refill rate in tokens per second: positive, finite, and
	// at least Capacity / MaxRefillPeriod. Per converts "n per duration".
	Rate float64
}

// Per returns the rate, in tokens per second, of n tokens every d. For
// example Per(1000, time.Hour) is 1000 tokens an hour.
func Per(n float64, d time.Duration) float64 {
	return n / d.Seconds()
}

// validate checks every rule of Plan.
func (p Plan) validate() error {
	if len(p.Name) < 1 || len(p.Name) > 64 {
		return fmt.Errorf("%w: name must be 1 to 64 bytes, got %d", ErrInvalidPlan, len(p.Name))
	}
	for i := 0; i < len(p.Name); i++ {
		c := p.Name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '.' || c == '-') {
			return fmt.Errorf("%w: name %q: only [A-Za-z0-9_.-] allowed", ErrInvalidPlan, p.Name)
		}
	}
	if err := p.validateNumbers(); err != nil {
		return fmt.Errorf("%w (plan %q)", err, p.Name)
	}
	return nil
}

// validateNumbers checks Capacity and Rate, the fields the arithmetic
// depends on. Stores call it on every request, since they accept plans
// from callers other than Limiter.
func (p Plan) validateNumbers() error {
	if p.Capacity < 1 || p.Capacity > maxCapacity {
		return fmt.Errorf("%w: capacity must be 1 to %d, got %d", ErrInvalidPlan, maxCapacity, p.Capacity)
	}
	if !(p.Rate > 0) || math.IsInf(p.Rate, 0) { // also rejects NaN
		return fmt.Errorf("%w: rate must be positive and finite, got %v", ErrInvalidPlan, p.Rate)
	}
	if float64(p.Capacity) > p.Rate*MaxRefillPeriod.Seconds() {
		return fmt.Errorf("%w: capacity/rate is %.3g s, longer than MaxRefillPeriod", ErrInvalidPlan, float64(p.Capacity)/p.Rate)
	}
	return nil
}
