package breaker

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"
)

// Errors of a Shared breaker. They are wrapped with detail, so match them
// with errors.Is. No error text ever holds a caller's key: keys may be
// personal data.
var (
	// ErrOpen means Acquire or Allow refused a call: the breaker is open,
	// or half-open with every probe lease taken. Ticket.RetryAfter says
	// when asking again may succeed.
	ErrOpen = errors.New("tollgate/breaker: circuit open")

	// ErrInvalidSettings means NewShared was given settings out of range
	// (see SharedSettings), an unknown FailurePolicy, a nil client or a
	// key prefix with a brace.
	ErrInvalidSettings = errors.New("tollgate/breaker: invalid settings")

	// ErrInvalidKey means a key is empty or longer than MaxKeyLen bytes.
	ErrInvalidKey = errors.New("tollgate/breaker: invalid key")

	// ErrTicketDone means Done was called on a Ticket that has already
	// been reported, or on one that Acquire did not grant.
	ErrTicketDone = errors.New("tollgate/breaker: ticket already reported or never granted")

	// ErrStale means an outcome was ignored because the breaker changed
	// state since its call was granted (another generation), or because the
	// probe lease it held has expired. Nothing is wrong; the outcome just
	// no longer says anything about the breaker's current state.
	ErrStale = errors.New("tollgate/breaker: outcome from an earlier generation ignored")

	// ErrForeignValue means State or Inspect found data at the breaker's
	// key that a Shared breaker did not write. They read it as a closed
	// breaker and do not change it; the next Acquire, Done or admin
	// operation replaces it.
	ErrForeignValue = errors.New("tollgate/breaker: foreign value at the breaker's key")

	// ErrStoreUnavailable means Redis could not answer. Acquire and Done
	// return it only under FailClosed; the admin operations, State and
	// Inspect under every policy. It is also tollgate.ErrStoreUnavailable,
	// which a Limiter returns under FailClosed, hence its text.
	ErrStoreUnavailable = errors.New("tollgate: store unavailable")
)

// MaxKeyLen is the longest key a Shared breaker takes, in bytes, as
// tollgate.MaxKeyLen.
const MaxKeyLen = 1024

// SharedSettings configures a Shared breaker. Zero fields mean their
// defaults; negative durations and counts, and rates outside (0, 1], are
// ErrInvalidSettings. Every instance that shares a breaker must use the
// same settings: each script call applies the settings of the caller.
type SharedSettings struct {
	// Window is the sliding time window over which FailureRate and
	// SlowRate are measured, counted in ten steps of Window/10 on Redis's
	// clock. At least 10µs. The default is 10s.
	Window time.Duration
	// MinCalls is the fewest calls in Window for the rates to apply. The
	// default is 20.
	MinCalls int
	// FailureRate is the fraction of failed calls in Window, above 0 and
	// at most 1, that trips the breaker once Window holds MinCalls calls.
	// It is kept to six decimal places. The default is 0.5.
	FailureRate float64
	// SlowCall is the duration from Acquire to Done at or above which a
	// call is slow, whatever its outcome. The default is 0: no call is
	// slow and SlowRate is unused.
	SlowCall time.Duration
	// SlowRate is the fraction of slow calls in Window, above 0 and at
	// most 1, that trips the breaker once Window holds MinCalls calls. The
	// default is 1.
	SlowRate float64
	// Consecutive is a run of failures, as Redis receives them from every
	// instance, that trips the breaker whatever the window holds: for
	// downstreams too quiet to reach MinCalls. A success anywhere in the
	// fleet ends the run. The default is 0: off.
	Consecutive int
	// OpenFor is how long a tripped breaker stays open before it grants
	// probe leases. The default is 30s.
	OpenFor time.Duration
	// MaxOpenFor, when above OpenFor, makes the open time double with
	// each failed probe in a row, up to MaxOpenFor; a closed breaker starts
	// again at OpenFor. The default is OpenFor: no growth. A value below
	// OpenFor is ErrInvalidSettings.
	MaxOpenFor time.Duration
	// Probes is the number of probe leases a half-open breaker grants
	// fleet-wide; that many successes close it, one failure opens it
	// again. At most 1000. The default is 1.
	Probes int
	// ProbeTimeout is how long a probe lease lasts. A prober that reports
	// nothing within it (it died, or hangs) loses the lease, which is
	// granted again, and its late outcome is ignored: the breaker never
	// stays half-open for ever. The default is 10s.
	ProbeTimeout time.Duration
	// CacheClosedFor, when above 0, lets an instance grant calls for this
	// long after Redis last said the breaker was closed, and keep their
	// outcomes to send with its next round trip for the key. So for up to
	// CacheClosedFor (plus a round trip) after another instance trips the
	// breaker, this instance still lets calls through, and its outcomes
	// reach Redis up to CacheClosedFor late. The default is 0: every
	// Acquire and every Done is a round trip.
	CacheClosedFor time.Duration
}

// withDefaults returns s with every zero field set to its default.
func (s SharedSettings) withDefaults() SharedSettings {
	if s.Window == 0 {
		s.Window = 10 * time.Second
	}
	if s.MinCalls == 0 {
		s.MinCalls = 20
	}
	if s.FailureRate == 0 {
		s.FailureRate = 0.5
	}
	if s.SlowRate == 0 {
		s.SlowRate = 1
	}
	if s.OpenFor == 0 {
		s.OpenFor = 30 * time.Second
	}
	if s.MaxOpenFor == 0 {
		s.MaxOpenFor = s.OpenFor
	}
	if s.Probes == 0 {
		s.Probes = 1
	}
	if s.ProbeTimeout == 0 {
		s.ProbeTimeout = 10 * time.Second
	}
	return s
}

// maxDuration is the longest duration a setting takes: a year, far below
// 2^53 µs, so that sums of times stay exact in the script.
const maxDuration = 365 * 24 * time.Hour

// validate returns ErrInvalidSettings naming the first field out of range.
func (s SharedSettings) validate() error {
	bad := func(field string) error { return fmt.Errorf("%w: %s out of range", ErrInvalidSettings, field) }
	durs := []struct {
		name string
		d    time.Duration
	}{{"Window", s.Window}, {"SlowCall", s.SlowCall}, {"OpenFor", s.OpenFor}, {"MaxOpenFor", s.MaxOpenFor},
		{"ProbeTimeout", s.ProbeTimeout}, {"CacheClosedFor", s.CacheClosedFor}}
	for _, d := range durs {
		if d.d < 0 || d.d > maxDuration {
			return bad(d.name)
		}
	}
	rate := func(r float64) bool { return r == 0 || (r > 0 && r <= 1 && !math.IsNaN(r)) }
	switch {
	case s.Window != 0 && s.Window < 10*time.Microsecond:
		return bad("Window")
	case s.MinCalls < 0 || s.MinCalls > math.MaxInt32:
		return bad("MinCalls")
	case !rate(s.FailureRate):
		return bad("FailureRate")
	case !rate(s.SlowRate):
		return bad("SlowRate")
	case s.Consecutive < 0 || s.Consecutive > math.MaxInt32:
		return bad("Consecutive")
	case s.Probes < 0 || s.Probes > 1000:
		return bad("Probes")
	}
	d := s.withDefaults()
	if d.MaxOpenFor < d.OpenFor {
		return bad("MaxOpenFor")
	}
	if d.OpenFor < time.Microsecond || d.ProbeTimeout < time.Microsecond {
		return bad("OpenFor or ProbeTimeout")
	}
	return nil
}

// params returns s (with defaults) as the script takes it.
func (s SharedSettings) params() params {
	ppm := func(r float64) int64 { return max(int64(math.Round(r*1e6)), 1) }
	slow := int64(0)
	if s.SlowCall > 0 {
		slow = ppm(s.SlowRate)
	}
	return params{
		window: s.Window.Microseconds(), minCalls: int64(s.MinCalls),
		rate: ppm(s.FailureRate), slowRate: slow, consecutive: int64(s.Consecutive),
		openFor: s.OpenFor.Microseconds(), maxOpenFor: s.MaxOpenFor.Microseconds(),
		probes: int64(s.Probes), probeTimeout: s.ProbeTimeout.Microseconds(),
	}
}

// FailurePolicy says how a Shared breaker, or a tollgate.Limiter
// (tollgate.WithFailurePolicy), decides while Redis fails.
type FailurePolicy int

const (
	// Fallback decides locally. A Shared breaker decides with a local
	// breaker per key, seeded from the last state this instance read from
	// Redis: an open breaker stays open until its open time ends, then
	// probes locally, and a forced one (ForceOpen) stays open; on recovery Redis's state wins and the local ones
	// are dropped. A Limiter has its fallback store decide (Source
	// SourceFallback): each instance then enforces the plans on its own,
	// or its share of them (tollgate.WithFleet). It is the default.
	Fallback FailurePolicy = iota
	// FailOpen grants every call while Redis fails (a Limiter's Source
	// SourceFailOpen).
	FailOpen
	// FailClosed refuses every call with ErrStoreUnavailable.
	FailClosed
)

// String returns "fallback", "fail-open" or "fail-closed".
func (p FailurePolicy) String() string {
	switch p {
	case Fallback:
		return "fallback"
	case FailOpen:
		return "fail-open"
	case FailClosed:
		return "fail-closed"
	}
	return "unknown"
}

// SharedOption configures a Shared breaker.
type SharedOption func(*sharedConfig)

type sharedConfig struct {
	prefix  string
	policy  FailurePolicy
	health  Settings
	log     *slog.Logger
	logKeys bool
}

// WithPrefix sets the prefix of the breaker's Redis keys, which are
// prefix:{key}:cb (see Shared.Key). It may not contain a brace. The default
// is "tollgate", the Limiter's.
func WithPrefix(p string) SharedOption {
	return func(c *sharedConfig) { c.prefix = p }
}

// WithFailurePolicy sets what a Shared breaker does while Redis fails. The
// default is Fallback.
func WithFailurePolicy(p FailurePolicy) SharedOption {
	return func(c *sharedConfig) { c.policy = p }
}

// WithStoreBreaker configures the local breaker in front of Redis, which
// stops calling a failing Redis for its Cooldown. The default is
// Settings{}, as a Limiter's: 3 failures in a row open it for 500ms.
func WithStoreBreaker(s Settings) SharedOption {
	return func(c *sharedConfig) { c.health = s }
}

// WithLogger sets where a Shared breaker logs: one line per transition that
// one of its calls made (so one line fleet-wide per transition), one
// warning when Redis starts failing and one line when it recovers. Keys are
// never logged. nil discards everything; a Logger without a Handler
// (&slog.Logger{}) is ErrInvalidSettings. The default is slog.Default().
func WithLogger(l *slog.Logger) SharedOption {
	return func(c *sharedConfig) {
		if l == nil {
			l = slog.New(slog.DiscardHandler)
		}
		c.log = l
	}
}

// WithLogKeys(true) adds the key to each transition's log line, for keys
// that are not personal data, such as destination host names. The default
// is false: keys are never logged.
func WithLogKeys(on bool) SharedOption {
	return func(c *sharedConfig) { c.logKeys = on }
}

// checkKey returns ErrInvalidKey for an empty or oversized key.
func checkKey(key string) error {
	if key == "" || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return nil
}

// checkPrefix returns ErrInvalidSettings for a prefix with a brace.
func checkPrefix(p string) error {
	if strings.ContainsAny(p, "{}") {
		return fmt.Errorf("%w: key prefix contains a brace", ErrInvalidSettings)
	}
	return nil
}
