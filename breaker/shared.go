package breaker

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/internal/isnil"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// maxKeys bounds the keys a Shared breaker remembers locally (open and
// closed memos, fallback breakers, probes of the CircuitBreaker form). Past it, it forgets
// them all and starts again: an open breaker then costs one round trip to
// be remembered again.
const maxKeys = 10_000

// Shared is a circuit breaker whose state lives in Redis, one hash per key
// (a downstream), shared by every instance that uses the same Redis and
// prefix. One Lua script changes it, on Redis's clock, so application
// clocks never matter and it is Cluster-safe.
//
// It trips on a failure rate (and optionally a slow-call rate) over a
// sliding window with a minimum number of calls, or on a run of
// consecutive failures; stays open for OpenFor (optionally growing); then
// grants exactly Probes expiring probe leases fleet-wide. Outcomes are
// fenced by generation: a call granted before a state change neither
// counts nor changes the state after it.
//
// A Shared breaker starts no goroutine and writes nothing at construction.
// It is safe for concurrent use.
type Shared struct {
	c       redis.Scripter
	set     SharedSettings // with defaults
	p       params
	prefix  string
	policy  FailurePolicy
	health  *Breaker
	log     *slog.Logger
	logKeys bool
	epoch   time.Time
	// now reads the instance's monotonic clock in ns; tests replace it.
	now func() int64

	mu     sync.RWMutex
	memos  map[string]*memo         // by key
	local  map[string]*localCircuit // by key: the Fallback breakers
	probes map[string][]Ticket      // by key: the probe tickets of Allow
	nlocal atomic.Int32             // len(local), read without the lock
	outage atomic.Int64             // wall ns when Redis began failing; 0: not failing
	// heard is when a call to Redis last succeeded, to the millisecond, on
	// the instance's clock; 0, when the breaker was made, if none has.
	heard atomic.Int64
	stats sharedCounters
}

// NewShared returns a Shared breaker on the Redis client c (a *redis.Client,
// *redis.ClusterClient, a failover client or a Ring). It checks c, s and
// the options and returns ErrInvalidSettings for a nil client (also a
// typed nil, such as a *redis.Client never set) or a setting out of range;
// it does not touch Redis.
func NewShared(c redis.Scripter, s SharedSettings, opts ...SharedOption) (*Shared, error) {
	cfg := sharedConfig{prefix: "tollgate", log: slog.Default()}
	for _, o := range opts {
		o(&cfg)
	}
	if isnil.Value(c) {
		return nil, fmt.Errorf("%w: nil Redis client", ErrInvalidSettings)
	}
	if err := s.validate(); err != nil {
		return nil, err
	}
	if err := checkPrefix(cfg.prefix); err != nil {
		return nil, err
	}
	if cfg.policy < Fallback || cfg.policy > FailClosed {
		return nil, fmt.Errorf("%w: unknown failure policy %d", ErrInvalidSettings, int(cfg.policy))
	}
	if cfg.log.Handler() == nil {
		return nil, fmt.Errorf("%w: a Logger without a Handler (make one with slog.New)", ErrInvalidSettings)
	}
	if !cfg.health.Valid() {
		return nil, fmt.Errorf("%w: store breaker settings out of range", ErrInvalidSettings)
	}
	b := &Shared{
		c: c, set: s.withDefaults(), prefix: cfg.prefix, policy: cfg.policy,
		health: New(cfg.health), log: cfg.log, logKeys: cfg.logKeys, epoch: time.Now(),
		memos: map[string]*memo{}, local: map[string]*localCircuit{}, probes: map[string][]Ticket{},
	}
	b.p = b.set.params()
	b.now = func() int64 { return int64(time.Since(b.epoch)) }
	return b, nil
}

// Settings returns the breaker's settings, defaults filled in.
func (b *Shared) Settings() SharedSettings { return b.set }

// Key returns the Redis key of key's breaker, prefix:{key}:cb, by the
// scheme of tollgate.RedisStore.Key: the braces are a Cluster hash
// tag, and a key holding '}' or starting with '=' is written as '=' and its
// base64url encoding. It is for operators; the key may be personal data.
func (b *Shared) Key(key string) string {
	var s strings.Builder
	s.WriteString(b.prefix)
	s.WriteString(":{")
	if strings.IndexByte(key, '}') >= 0 || strings.HasPrefix(key, "=") {
		s.WriteString("=")
		s.WriteString(base64.RawURLEncoding.EncodeToString([]byte(key)))
	} else {
		s.WriteString(key)
	}
	s.WriteString("}:cb")
	return s.String()
}

// Outcome is what a granted call reports to Ticket.Done.
type Outcome int

const (
	// Success is a call that worked.
	Success Outcome = iota
	// Failure is a call that failed in a way the breaker should count.
	Failure
	// Ignore is a call that tells nothing about the downstream, such as
	// one its own caller cancelled. It counts nothing, and a probe that
	// ends so hands its lease to the next caller at once.
	Ignore
)

// Ticket is a call that Acquire granted; report its outcome with Done,
// exactly once. When Acquire refuses with ErrOpen, only RetryAfter is set.
// A Ticket is a small value; copies share whether it has been reported.
type Ticket struct {
	// RetryAfter is, when Acquire returned ErrOpen, how long until the
	// breaker may grant a probe: the rest of its open time, or of the
	// shortest probe lease in flight.
	RetryAfter time.Duration
	t          *ticket
}

// Ticket modes: who granted it, so who hears its outcome.
const (
	modeRedis    = iota // Redis: Done is a round trip
	modeCached          // this instance, from its closed cache: Done is batched
	modeLocal           // the Fallback breaker
	modeFailOpen        // FailOpen: Done does nothing
)

type ticket struct {
	b     *Shared
	key   string
	m     *memo
	gen   int64
	token uint64 // 0 unless a probe
	start int64  // on the instance's clock
	state State  // the state it was granted in: Closed or HalfOpen
	mode  uint8
	done  atomic.Bool
}

// Probe reports whether the ticket holds a half-open probe lease.
func (t Ticket) Probe() bool { return t.t != nil && t.t.token != 0 }

// Generation returns the breaker's generation when the call was granted: it
// grows by one at every state change. 0 for a refused call.
func (t Ticket) Generation() int64 {
	if t.t == nil {
		return 0
	}
	return t.t.gen
}

// Acquire asks whether a call to key's downstream may go through. It
// returns a Ticket to report the call's outcome with, or ErrOpen with
// Ticket.RetryAfter set. A breaker this instance knows to be open answers
// without Redis and without allocating until its open time ends.
//
// While Redis fails, the failure policy decides. A context that has ended
// is the caller's error, before or during the call to Redis, and is never
// counted against Redis.
func (b *Shared) Acquire(ctx context.Context, key string) (Ticket, error) {
	if err := checkKey(key); err != nil {
		return Ticket{}, err
	}
	if err := ctx.Err(); err != nil {
		return Ticket{}, err
	}
	now := b.now()
	m := b.memo(key)
	if m != nil {
		if until := m.openUntil.Load(); until != 0 && now < until {
			b.stats.rejected[Open].Add(1)
			return Ticket{RetryAfter: time.Duration(until - now)}, ErrOpen
		}
		if until := m.closedUntil.Load(); until != 0 && now < until {
			b.stats.granted[Closed].Add(1)
			return Ticket{t: &ticket{b: b, key: key, m: m, gen: m.gen.Load(), start: now, mode: modeCached}}, nil
		}
	}
	token := rand.Uint64() | 1 // never 0, which means no token
	in := input{op: opAcquire, token: token}
	if m != nil && b.set.CacheClosedFor > 0 {
		in.b, in.gen = m.takePending()
	}
	r, m, err := b.run(ctx, key, m, in, now)
	if err != nil {
		var rerr *redisscript.Error
		if in.b.calls > 0 && (errors.Is(err, errStoreBreakerOpen) || errors.As(err, &rerr)) {
			// Never sent, or refused by Redis before the script ran: keep
			// the outcomes for the next round trip. After a timeout the
			// script may have run, and they are dropped rather than
			// counted twice.
			m.returnPending(in.b, in.gen)
		}
		if cerr, ok := err.(callerError); ok {
			return Ticket{}, cerr.err
		}
		return b.degradeAcquire(key, now, err)
	}
	switch r.grant {
	case grantClosed:
		b.stats.granted[Closed].Add(1)
		mode := uint8(modeRedis)
		if b.set.CacheClosedFor > 0 {
			mode = modeCached // its outcome goes with the next round trip
		}
		return Ticket{t: &ticket{b: b, key: key, m: m, gen: r.gen, start: now, state: Closed, mode: mode}}, nil
	case grantProbe:
		b.stats.granted[HalfOpen].Add(1)
		return Ticket{t: &ticket{b: b, key: key, m: m, gen: r.gen, token: token, start: now, state: HalfOpen}}, nil
	}
	b.stats.rejected[r.state].Add(1)
	return Ticket{RetryAfter: time.Duration(r.wait) * time.Microsecond}, ErrOpen
}

// Done reports the outcome of the ticket's call. A call slower than
// SlowCall also counts as slow. It returns ErrStale when the breaker has
// changed state since the call was granted, or the probe's lease has
// expired: the outcome is then ignored. With CacheClosedFor, the outcome of
// a call granted from the cache is kept to send with the next round trip,
// and Done returns nil without knowing whether it will count.
//
// Done is a round trip, so pass a context that is still live: one that
// has ended returns its error and the outcome is lost (a probe's lease then
// frees itself after ProbeTimeout). context.WithoutCancel of a request's
// context, with a timeout, reports the outcome of a call whose request
// has gone.
//
// Under FailClosed, a Redis failure is ErrStoreUnavailable; under the other
// policies the outcome is dropped and Done returns nil. Done on a ticket
// already reported, or on a refused call's, is ErrTicketDone.
func (t Ticket) Done(ctx context.Context, o Outcome) error {
	tk := t.t
	if tk == nil || !tk.done.CompareAndSwap(false, true) {
		return ErrTicketDone
	}
	b := tk.b
	now := b.now()
	bt := tk.outcome(o, now)
	switch tk.mode {
	case modeFailOpen:
		return nil
	case modeLocal:
		return b.doneLocal(tk, bt, now)
	case modeCached:
		tk.m.pend(tk.gen, bt)
		return nil
	}
	if bt.calls == 0 && tk.token == 0 {
		return nil // an ignored closed call: nothing to tell Redis
	}
	r, _, err := b.run(ctx, tk.key, tk.m, input{op: opRecord, token: tk.token, gen: tk.gen, b: bt}, now)
	if err != nil {
		if cerr, ok := err.(callerError); ok {
			return cerr.err
		}
		if b.policy == FailClosed {
			return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
		}
		return nil
	}
	if r.ignored == 1 {
		b.stats.stale.Add(1)
		return ErrStale
	}
	return nil
}

// outcome counts outcome o of the call of tk, reported at now (ns), in
// the breaker's stats, and returns it as a batch of one call, or of none
// for Ignore.
func (tk *ticket) outcome(o Outcome, now int64) batch {
	var bt batch
	if o == Ignore {
		return bt
	}
	b := tk.b
	bt.calls = 1
	if o == Failure {
		bt.failures, bt.run = 1, 1
		b.stats.failures[tk.state].Add(1)
	} else {
		bt.succeeded = true
		b.stats.successes[tk.state].Add(1)
	}
	if b.set.SlowCall > 0 && time.Duration(now-tk.start) >= b.set.SlowCall {
		bt.slow = 1
	}
	b.stats.slow[tk.state].Add(uint64(bt.slow))
	return bt
}
