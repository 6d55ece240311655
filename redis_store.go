package tollgate

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/internal/isnil"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// defaultKeyPrefix is the first part of every Redis key unless
// WithKeyPrefix says otherwise.
const defaultKeyPrefix = "tollgate"

// RedisStore is a Store that keeps buckets in Redis, shared by every
// instance that uses the same Redis and key prefix. It is safe for
// concurrent use.
//
// Each decision is one call of embedded Lua, atomic across every chained
// plan, with Redis TIME as the only clock: EVALSHA of a script, or, for a
// take or read on one token bucket plan without a version, not shadowed,
// an FCALL of a function (Redis 7.0 and later), which does less work in
// Redis. When Redis answers NOSCRIPT, or has no such function (after a
// restart, SCRIPT FLUSH, FUNCTION FLUSH or failover), the store sends the
// script with EVAL, or the library with FUNCTION LOAD, and carries on:
// callers never see it. A server without functions (before 7.0), or an
// ACL that forbids FCALL or FUNCTION LOAD, gets the function's script
// with EVALSHA instead, as the store learns at its first such decision.
// Errors Redis answers reach the caller as their class ("OOM",
// "READONLY", ...) without Redis's text, which can quote a key.
//
// It works with every go-redis client: Client, ClusterClient, the failover
// (Sentinel) client and Ring. It needs Redis 5.0 or later, which replicates
// a script's effects rather than the script, so reading TIME before writing
// is allowed; tests run on Redis 7.0.
type RedisStore struct {
	client       redis.UniversalClient
	prefix       string
	err          error            // a wiring mistake: New reports it, and so does every call
	scripts      *decisionScripts // what a decision runs (lean.go)
	settleScript *redisscript.Script
	resetScript  *redisscript.Script
	permitScript *redisscript.Script
	random       func() uint64 // draws for suppressed plans; tests replace it
	planArgs     planArgCache  // each plan's ARGV numbers, boxed
	batch        *batcher      // nil WithoutBatching, or on a client other than a *redis.Client (batch.go)
}

// NewRedisStore returns a RedisStore that uses client. A nil client (also
// a typed nil, such as a *redis.Client never set) or an unusable option is
// a wiring mistake, reported as ErrInvalidOption by New
// when the store is given to a Limiter, so that it shows at startup, and
// by every call of a store used on its own.
func NewRedisStore(client redis.UniversalClient, opts ...Option) *RedisStore {
	c := config{keyPrefix: defaultKeyPrefix}
	err := applyOptions(&c, takerRedisStore, opts)
	s := &RedisStore{client: client, prefix: c.keyPrefix, scripts: newDecisionScripts(),
		settleScript: redisscript.New(settleScript), resetScript: redisscript.New(resetScript),
		permitScript: redisscript.New(permitScript), random: random53}
	switch {
	case err != nil:
		s.err = err
	case isnil.Value(client):
		s.err = fmt.Errorf("%w: nil Redis client", ErrInvalidOption)
	case strings.ContainsAny(s.prefix, "{}"):
		s.err = fmt.Errorf("%w: key prefix contains a brace", ErrInvalidOption)
	case !c.unbatched:
		s.batchCalls()
	}
	return s
}

// ScriptLoads returns how many times the store has sent its scripts'
// source after Redis answered NOSCRIPT, or its library of functions after
// Redis answered that it had none of them.
func (s *RedisStore) ScriptLoads() int64 {
	return s.scripts.loads() + s.settleScript.Loads() + s.resetScript.Loads() + s.permitScript.Loads()
}

// Take implements Store.
func (s *RedisStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if err := checkTake(key, cost, plans); err != nil {
		return Result{}, err
	}
	return s.take(ctx, key, cost, plans)
}

// decide implements decider: a take, a read or a hold, already checked.
func (s *RedisStore) decide(ctx context.Context, o op) (Result, error) {
	switch o.mode {
	case modeHold:
		return s.hold(ctx, o.key, o.n, o.plans, o.hold)
	case modeAcquire:
		return s.acquire(ctx, o)
	}
	return s.take(ctx, o.key, o.cost(), o.plans)
}

func (s *RedisStore) self() Store { return s }

// wiringError implements wiredStore: a nil client or an unusable option.
func (s *RedisStore) wiringError() error { return s.err }

// take is Take for a request already checked.
func (s *RedisStore) take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if s.err != nil {
		return Result{}, s.err
	}
	c := newScriptCall()
	c.Keys = s.appendKeys(c.keys[:0], key, plans)
	c.Args = s.appendArgs(c.args[:0], cost, plans)
	c.lean = lean(plans)
	return s.run(ctx, c, cost, plans)
}

// run runs the script for c, through the batcher if there is one, on the
// state of plans, and describes its decision. c is the batcher's or
// recycled once run returns.
func (s *RedisStore) run(ctx context.Context, c *scriptCall, cost int64, plans []Plan) (Result, error) {
	r, _, err := s.runAt(ctx, c, cost, plans)
	_, err = leftOf(err)
	return r, err
}

// runAt is run that also returns when the script decided: the Redis TIME
// it read, in µs.
func (s *RedisStore) runAt(ctx context.Context, c *scriptCall, cost int64, plans []Plan) (Result, int64, error) {
	reply, err := s.eval(ctx, c)
	if err != nil {
		return Result{}, 0, err
	}
	// Up to four plans without allocating.
	var bstack [4]TokenBucket
	var wstack [4]planState
	buckets, windows := bstack[:], wstack[:]
	if len(plans) > len(bstack) {
		buckets, windows = make([]TokenBucket, len(plans)), make([]planState, len(plans))
	}
	allowed, now, wd, err := parseReply(buckets, windows, reply, plans, cost)
	if err != nil {
		return Result{}, 0, err
	}
	return newResult(&outcome{plans: plans, buckets: buckets, windows: windows, now: now, cost: cost, allowed: allowed, wd: wd}), now, nil
}

// pooledPlans is how many plans a scriptCall holds the keys and ARGV of
// without allocating: the four that run keeps on the stack too.
const pooledPlans = 4

// scriptCall is one decision's call of the limit script: its keys and
// ARGV, and, with batching, what its waiting caller needs. The keys and
// ARGV are built in the call's own arrays, and calls are recycled through
// scriptCalls, so that a decision allocates neither slice: go-redis copies
// both into a command of its own before EvalSha returns, and a batch into
// its own slices before it is sent.
type scriptCall struct {
	redisscript.Call
	ctx  context.Context // with batching, the waiting caller's
	done chan struct{}   // with batching, receives once Reply or Err is set, or lead
	lead bool            // with batching, given a call slot to send a batch
	lean bool            // runs the lean decision (lean.go)

	keys [pooledPlans + 1]string    // + 1 for a hold's key
	args [2 + 4*pooledPlans + 1]any // the wide layout, + 1 for a hold's TTL
}

// scriptCalls recycles scriptCall values, with their arrays and channels,
// between decisions.
var scriptCalls = sync.Pool{New: func() any { return &scriptCall{done: make(chan struct{}, 1)} }}

// newScriptCall returns an empty scriptCall from scriptCalls.
func newScriptCall() *scriptCall { return scriptCalls.Get().(*scriptCall) }

// recycle empties c and puts it back in scriptCalls. Only the owner of c
// may call it, once nothing else can read or write c: not a batcher's
// waiting caller that gave up while its call may still be sent.
func (c *scriptCall) recycle() {
	clear(c.keys[:]) // keep no caller's key or reply alive in the pool
	clear(c.args[:])
	c.Call, c.ctx, c.lead, c.lean = redisscript.Call{}, nil, false, false
	scriptCalls.Put(c)
}

// args returns the script's ARGV for a decision, in a slice of its own.
func (s *RedisStore) args(cost int64, plans []Plan) []any {
	return s.appendArgs(nil, cost, plans)
}

// appendArgs appends the script's ARGV for a decision to dst (see
// scripts/limit.lua): for buckets alone, the cost and each plan's
// capacity and rate; with windows, the cost, a random number drawn if a
// plan is suppressed, and four numbers per plan. Each plan's numbers
// come boxed from the store's planArgs, so that they cost no allocation
// once the plan has been seen.
func (s *RedisStore) appendArgs(dst []any, cost int64, plans []Plan) []any {
	dst = append(dst, cost)
	if !windowIn(plans) && !versionedIn(plans) {
		for i := range plans {
			dst = s.planArgs.appendTo(dst, &plans[i], 2)
		}
		return dst
	}
	dst = append(dst, s.draw(plans))
	for i := range plans {
		dst = s.planArgs.appendTo(dst, &plans[i], 4)
	}
	return dst
}

// draw returns the wide layout's random number for plans: drawn if a plan
// is suppressed, else 0.
func (s *RedisStore) draw(plans []Plan) any {
	if suppressedIn(plans) {
		return s.random()
	}
	return 0
}

// planArgCache keeps the ARGV numbers of the plans a store has seen,
// boxed once: putting an int64 of 256 or more, or a string, in an `any`
// allocates, and a plan's numbers are the same in every decision. It is a
// map that is copied on write and holds at most maxCachedPlans plans, so
// that reading it takes no lock; plans beyond those (a resolver that
// makes a plan per user, say) are boxed on every decision, as they were
// before it. It is safe for concurrent use.
type planArgCache struct {
	m  atomic.Pointer[map[Plan]*planArgs]
	mu sync.Mutex // serializes writers
}

// maxCachedPlans bounds a planArgCache: about 200 bytes a plan (its
// 72-byte key, 64 bytes of boxes and what they box), 50 KB when full.
const maxCachedPlans = 256

// planArgs are one plan's four numbers in the script's wide ARGV layout:
// for a token bucket, its capacity (negative if shadowed, see
// capacityArg), rate, 0 and version; for a window, its capacity, width,
// slots, and hard limit if suppressed, else 0. The narrow layout, for
// buckets alone, takes the first two.
type planArgs [4]any

// appendTo appends the first n of plan p's boxed numbers to dst.
func (c *planArgCache) appendTo(dst []any, p *Plan, n int) []any {
	if m := c.m.Load(); m != nil {
		if a := (*m)[*p]; a != nil {
			return append(dst, a[:n]...)
		}
	}
	a := c.add(p)
	return append(dst, a[:n]...)
}

// add boxes the numbers of plan p and keeps them if the cache has room.
func (c *planArgCache) add(p *Plan) planArgs {
	a := newPlanArgs(p)
	if m := c.m.Load(); m != nil && len(*m) >= maxCachedPlans {
		return a
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	if old != nil && len(*old) >= maxCachedPlans {
		return a
	}
	next := make(map[Plan]*planArgs)
	if old != nil {
		next = maps.Clone(*old)
	}
	kept := a
	next[*p] = &kept
	c.m.Store(&next)
	return a
}

// newPlanArgs boxes the numbers of plan p (see planArgs).
func newPlanArgs(p *Plan) planArgs {
	switch {
	case !p.isWindow():
		return planArgs{capacityArg(p), formatRate(p.Rate), 0, versionArg(p)}
	case p.Suppress != 0:
		return planArgs{capacityArg(p), p.width(), p.slots(), p.hardLimit()}
	default:
		return planArgs{capacityArg(p), p.width(), p.slots(), 0}
	}
}

// formatRate writes a rate as the shortest decimal that parses back to it
// exactly, never in exponent form: gopher-lua's tonumber, which miniredis
// runs, reads "1e-05" as nil.
func formatRate(rate float64) string {
	return strconv.FormatFloat(rate, 'f', -1, 64)
}

// replyLen returns the length of the script's reply for plans: two
// integers, then two per bucket and four per window.
func replyLen(plans []Plan) int {
	n := 2
	for _, p := range plans {
		n += 2 // a bucket, or a concurrency plan
		if p.isWindow() {
			n += 2
		}
	}
	return n
}

// maxWait bounds every wait a reply may tell, in µs: no plan's bucket
// fills, nor its window empties, in longer.
var maxWait = 2 * maxRefillPeriod.Microseconds()

// parseReply checks the shape of the script's reply instead of trusting it
// (see scripts/limit.lua): all integers, with counts, tokens and stamps
// that Lua's doubles hold exactly, and waits no plan could tell. It puts
// the bucket of bucket plan i in buckets[i], as stored, and the state of
// window plan i in windows[i]. A stamp after now (Redis TIME stepped back)
// or tokens above a capacity that shrank are for Refill to judge, as the
// next decision will; but a bucket that an allowed take took from was
// refilled, so a stamp more than the longest refill after now is an error.
func parseReply(buckets []TokenBucket, windows []planState, reply any, plans []Plan, cost int64) (allowed bool, now int64, wd uint64, err error) {
	var stack [2 + 4*4]int64
	vals, err := replyInts(stack[:0], reply, replyLen(plans))
	if err != nil {
		return false, 0, 0, err
	}
	// The allowed bit, then a bit per shadowed plan that would deny.
	if wd = uint64(vals[0]) >> 1; vals[0] < 0 || wd&^shadowMask(plans) != 0 {
		return false, 0, 0, fmt.Errorf("%w: allowed flag is %d", redisscript.ErrBadReply, vals[0])
	}
	allowed, now = vals[0]&1 == 1, vals[1]
	vals = vals[2:]
	for i := range plans {
		p := &plans[i]
		if p.Concurrency {
			free, reclaimed := vals[0], vals[1]
			if free > p.Capacity || reclaimed < 0 {
				return false, 0, 0, fmt.Errorf("%w: a concurrency plan's count is out of range", redisscript.ErrBadReply)
			}
			windows[i] = permitState(free, reclaimed, cost, allowed)
			vals = vals[2:]
			continue
		}
		if !p.isWindow() {
			// A bucket taken from was refilled first: its stamp is at
			// most a full refill after now, and the waits told from it
			// fit a time.Duration.
			if taken := allowed && cost > 0 && wd&(1<<i) == 0; taken && vals[1]-now > maxRefillPeriod.Microseconds() {
				return false, 0, 0, fmt.Errorf("%w: a bucket's stamp is out of range", redisscript.ErrBadReply)
			}
			buckets[i] = TokenBucket{Tokens: vals[0], Stamp: vals[1]}
			vals = vals[2:]
			continue
		}
		admitted, offered, ready, reset := vals[0], vals[1], vals[2], vals[3]
		if ready < now || reset < now || ready-now > maxWait || reset-now > maxWait {
			return false, 0, 0, fmt.Errorf("%w: a window's wait is out of range", redisscript.ErrBadReply)
		}
		windows[i] = windowState(p, windowCounts{admitted, offered, ready, reset}, now, cost, allowed && wd&(1<<i) == 0)
		vals = vals[4:]
	}
	return allowed, now, wd, nil
}
