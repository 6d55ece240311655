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
	stats  sharedCounters
}

// memo is what an instance remembers of one key's shared state.
type memo struct {
	rkey        string
	openUntil   atomic.Int64 // on the instance's clock: refuse without Redis until then; 0 none
	closedUntil atomic.Int64 // with CacheClosedFor: grant without Redis until then; 0 none
	gen         atomic.Int64 // the generation Redis last reported
	state       atomic.Int64 // the state Redis last reported

	mu      sync.Mutex
	pending batch // outcomes of locally granted calls, for the next round trip
	pendGen int64
}

// localCircuit is a Fallback breaker of one key.
type localCircuit struct {
	mu sync.Mutex
	c  circuit
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
		m.mu.Lock()
		in.b, in.gen = m.pending, m.pendGen
		m.pending = batch{}
		m.mu.Unlock()
	}
	r, m, err := b.run(ctx, key, m, in, now)
	if err != nil {
		var rerr *redisscript.Error
		if in.b.calls > 0 && (errors.Is(err, errStoreBreakerOpen) || errors.As(err, &rerr)) {
			// Never sent, or refused by Redis before the script ran: keep
			// the outcomes for the next round trip. After a timeout the
			// script may have run, and they are dropped rather than
			// counted twice.
			m.mu.Lock()
			if m.pendGen == in.gen {
				m.pending = in.b.add(m.pending)
			}
			m.mu.Unlock()
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
	bt := batch{}
	if o != Ignore {
		bt.calls = 1
		if o == Failure {
			bt.failures, bt.run = 1, 1
		} else {
			bt.succeeded = true
		}
		if b.set.SlowCall > 0 && time.Duration(now-tk.start) >= b.set.SlowCall {
			bt.slow = 1
		}
		if o == Failure {
			b.stats.failures[tk.state].Add(1)
		} else {
			b.stats.successes[tk.state].Add(1)
		}
		b.stats.slow[tk.state].Add(uint64(bt.slow))
	}
	switch tk.mode {
	case modeFailOpen:
		return nil
	case modeLocal:
		return b.doneLocal(tk, bt, now)
	case modeCached:
		if bt.calls == 0 {
			return nil
		}
		m := tk.m
		m.mu.Lock()
		if m.pendGen != tk.gen {
			m.pending, m.pendGen = batch{}, tk.gen
		}
		m.pending = m.pending.add(bt)
		m.mu.Unlock()
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

// callerError marks an error of the caller's own doing (its context), which
// must reach the caller as it is and never count against Redis.
type callerError struct{ err error }

func (e callerError) Error() string { return e.err.Error() }

// deadlineSlack is how close to its deadline a caller may be for a Redis
// call that timed out to count as cut short by the caller.
const deadlineSlack = time.Millisecond

// run runs the script for key with in, behind the store breaker, and
// updates the key's memo from the reply. It returns the reply and the memo
// (created if m was nil and the call succeeded). A failure of the caller's
// doing comes back as a callerError; any other error is Redis's, already
// counted.
func (b *Shared) run(ctx context.Context, key string, m *memo, in input, start int64) (reply, *memo, error) {
	gen, ok, probe := b.health.Admit()
	if !ok {
		return reply{}, m, errStoreBreakerOpen
	}
	rkey := ""
	if m != nil {
		rkey = m.rkey
	} else {
		rkey = b.Key(key)
	}
	r, err := b.eval(ctx, rkey, in, probe, gen)
	if err != nil {
		var rerr *redisscript.Error
		answered := errors.As(err, &rerr) || errors.Is(err, redisscript.ErrBadReply)
		cerr := ctx.Err()
		if cerr == nil && !answered {
			if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= deadlineSlack {
				cerr = context.DeadlineExceeded
			}
		}
		if cerr != nil && !answered {
			if probe {
				b.health.AbandonIn(gen)
			}
			return reply{}, m, callerError{cerr}
		}
		b.stats.storeErrors.Add(1)
		if b.health.FailureIn(gen) && b.outage.CompareAndSwap(0, time.Now().UnixNano()) {
			b.log.Warn("tollgate/breaker: Redis failing; deciding by failure policy until it recovers",
				"policy", b.policy.String(), "error", err)
		}
		return reply{}, m, err
	}
	b.health.SuccessIn(gen)
	if b.health.State() == Closed {
		if began := b.outage.Swap(0); began != 0 {
			b.log.Info("tollgate/breaker: Redis recovered", "outage", time.Duration(time.Now().UnixNano()-began))
		}
	}
	if b.nlocal.Load() > 0 {
		b.dropLocal(key) // Redis's state wins again
	}
	if m == nil {
		m = b.newMemo(key, rkey)
	}
	b.learn(key, m, r, in, start)
	return r, m, nil
}

var errStoreBreakerOpen = errors.New("store breaker open")

// eval runs the script on rkey with in and reads its reply. A probe of the
// store breaker (of generation gen) that does not return, because the
// client panics or its goroutine exits, is abandoned, or the breaker would
// stay half-open for ever: the next call probes.
func (b *Shared) eval(ctx context.Context, rkey string, in input, probe bool, gen uint64) (r reply, err error) {
	returned := false
	if probe {
		defer func() {
			if !returned {
				b.health.AbandonIn(gen)
			}
		}()
	}
	args := make([]any, 0, 17)
	args = append(args, in.op, in.token, in.gen, in.b.calls, in.b.failures, in.b.slow, in.b.run, boolInt(in.b.succeeded))
	args = append(args, b.p.args()...)
	b.stats.roundTrips.Add(1)
	raw, err := script.Run(ctx, b.c, []string{rkey}, args...)
	returned = true
	if err != nil {
		return reply{}, err
	}
	var buf [replyLen]int64
	vals, err := redisscript.Ints(buf[:0], raw, replyLen)
	if err != nil {
		return reply{}, err
	}
	r = reply{vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7], vals[8], vals[9], vals[10], vals[11]}
	if r.state > stateHalfOpen {
		return reply{}, fmt.Errorf("%w: state %d", redisscript.ErrBadReply, r.state)
	}
	return r, nil
}

// learn updates m from a reply to a call sent at start, and logs and counts
// what the reply says happened.
func (b *Shared) learn(key string, m *memo, r reply, in input, start int64) {
	if m != nil {
		m.gen.Store(r.gen)
		m.state.Store(r.state)
		// Deadlines count from when the call was sent, which is before
		// Redis read its clock: the instance never refuses longer than
		// Redis would.
		switch {
		case r.state == stateOpen:
			m.openUntil.Store(start + r.wait*1000)
			m.closedUntil.Store(0)
		case r.state == stateClosed && b.set.CacheClosedFor > 0 && in.op == opAcquire:
			m.openUntil.Store(0)
			m.mu.Lock()
			if m.pendGen != r.gen {
				m.pending, m.pendGen = batch{}, r.gen
			}
			m.mu.Unlock()
			m.closedUntil.Store(start + int64(b.set.CacheClosedFor))
		case r.state == stateClosed:
			m.openUntil.Store(0) // a closed cache stays as its acquire set it
		default:
			m.openUntil.Store(0)
			m.closedUntil.Store(0)
		}
	}
	if r.foreign == 1 && in.op != opRead {
		b.stats.foreign.Add(1)
		b.log.Warn("tollgate/breaker: replaced a foreign value at a breaker's key")
	}
	if r.from != 0 {
		b.transitioned(key, r, in.op, false)
	}
}

// transitioned counts and logs one state change that this instance's call
// made; every change of a shared state happens in exactly one script call,
// so the fleet logs each once. local marks a Fallback breaker's change.
func (b *Shared) transitioned(key string, r reply, op int, local bool) {
	from, to := State(r.from-1), State(r.state)
	b.stats.entered[to].Add(1)
	if from == Closed && to == Open && op < opForceOpen {
		b.stats.trips.Add(1)
	}
	level, msg := slog.LevelInfo, "tollgate/breaker: "+from.String()+" → "+to.String()
	switch {
	case op == opForceOpen:
		msg = "tollgate/breaker: forced open"
	case op == opForceClosed:
		msg = "tollgate/breaker: forced closed"
	case op == opReset:
		msg = "tollgate/breaker: reset"
	case to == Open:
		level = slog.LevelWarn
	}
	attrs := []slog.Attr{slog.String("from", from.String()), slog.String("to", to.String()),
		slog.Int64("generation", r.gen), slog.Int64("trips", r.trips), slog.Bool("local", local)}
	if b.logKeys {
		attrs = append(attrs, slog.String("key", key))
	}
	b.log.LogAttrs(context.Background(), level, msg, attrs...)
}

// memo returns key's memo, or nil.
func (b *Shared) memo(key string) *memo {
	b.mu.RLock()
	m := b.memos[key]
	b.mu.RUnlock()
	return m
}

// newMemo returns key's memo, creating it.
func (b *Shared) newMemo(key, rkey string) *memo {
	b.mu.Lock()
	defer b.mu.Unlock()
	if m := b.memos[key]; m != nil {
		return m
	}
	if len(b.memos) >= maxKeys {
		b.memos = map[string]*memo{}
	}
	m := &memo{rkey: rkey}
	b.memos[key] = m
	return m
}

// degradeAcquire decides a call by the failure policy, Redis having failed
// with cause.
func (b *Shared) degradeAcquire(key string, now int64, cause error) (Ticket, error) {
	b.stats.degraded.Add(1)
	switch b.policy {
	case FailOpen:
		return Ticket{t: &ticket{b: b, key: key, start: now, mode: modeFailOpen}}, nil
	case FailClosed:
		return Ticket{}, fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	lc := b.localCircuit(key, now)
	token := rand.Uint64() | 1
	lc.mu.Lock()
	r := lc.c.step(localUs(now), input{op: opAcquire, token: token}, b.p)
	lc.mu.Unlock()
	if r.from != 0 {
		b.transitioned(key, r, opAcquire, true)
	}
	switch r.grant {
	case grantClosed:
		b.stats.granted[Closed].Add(1)
		return Ticket{t: &ticket{b: b, key: key, gen: r.gen, start: now, state: Closed, mode: modeLocal}}, nil
	case grantProbe:
		b.stats.granted[HalfOpen].Add(1)
		return Ticket{t: &ticket{b: b, key: key, gen: r.gen, token: token, start: now, state: HalfOpen, mode: modeLocal}}, nil
	}
	b.stats.rejected[r.state].Add(1)
	return Ticket{RetryAfter: time.Duration(r.wait) * time.Microsecond}, ErrOpen
}

// localCircuit returns key's Fallback breaker, seeding a new one from what
// the instance last read from Redis: an open breaker stays open until its
// open time ends, and a half-open one probes at once.
func (b *Shared) localCircuit(key string, now int64) *localCircuit {
	b.mu.Lock()
	defer b.mu.Unlock()
	if lc := b.local[key]; lc != nil {
		return lc
	}
	if len(b.local) >= maxKeys {
		b.local = map[string]*localCircuit{}
	}
	lc := &localCircuit{}
	if m := b.memos[key]; m != nil {
		lc.c.gen = m.gen.Load()
		switch m.state.Load() {
		case stateOpen:
			lc.c.state, lc.c.openUntil = stateOpen, localUs(max(m.openUntil.Load(), now))
		case stateHalfOpen:
			lc.c.state, lc.c.openUntil = stateOpen, localUs(now)
		}
	}
	b.local[key] = lc
	b.nlocal.Store(int32(len(b.local)))
	return lc
}

// dropLocal forgets every Fallback breaker once Redis answers again.
func (b *Shared) dropLocal(string) {
	b.mu.Lock()
	b.local = map[string]*localCircuit{}
	b.nlocal.Store(0)
	b.mu.Unlock()
}

// doneLocal reports a Fallback ticket's outcome to its local breaker, if
// that breaker still exists.
func (b *Shared) doneLocal(tk *ticket, bt batch, now int64) error {
	b.mu.RLock()
	lc := b.local[tk.key]
	b.mu.RUnlock()
	if lc == nil {
		return nil // Redis is back; its state wins
	}
	lc.mu.Lock()
	r := lc.c.step(localUs(now), input{op: opRecord, token: tk.token, gen: tk.gen, b: bt}, b.p)
	lc.mu.Unlock()
	if r.from != 0 {
		b.transitioned(tk.key, r, opRecord, true)
	}
	if r.ignored == 1 {
		b.stats.stale.Add(1)
		return ErrStale
	}
	return nil
}

// localUs converts the instance's clock (ns) to the µs a Fallback breaker
// runs on, which must not be negative: the window's steps are indexed by
// it.
func localUs(ns int64) int64 { return ns/1000 + 1<<50 }
