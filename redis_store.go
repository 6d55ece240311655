package tollgate

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/scripts"
)

// defaultKeyPrefix is the first part of every Redis key unless
// WithKeyPrefix says otherwise.
const defaultKeyPrefix = "tollgate"

// RedisStore is a Store that keeps buckets in Redis, shared by every
// instance that uses the same Redis and key prefix. It is safe for
// concurrent use.
//
// Each decision is one EVALSHA of an embedded Lua script, atomic across
// every chained plan, with Redis TIME as the only clock. When Redis answers
// NOSCRIPT (after a restart, SCRIPT FLUSH or failover) the store sends the
// script with EVAL, which loads it, and carries on: callers never see it.
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
	err          error // a wiring mistake: New reports it, and so does every call
	script       *redisscript.Script
	settleScript *redisscript.Script
	random       func() uint64 // draws for suppressed plans; tests replace it
	batch        *batcher      // nil unless WithBatching (batch.go)
}

// RedisOption configures a RedisStore.
type RedisOption func(*RedisStore)

// WithKeyPrefix sets the first part of every Redis key; instances share
// buckets only when they share it. It must not contain '{' or '}', which
// would move the Cluster hash tag. The default is "tollgate".
func WithKeyPrefix(prefix string) RedisOption {
	return func(s *RedisStore) { s.prefix = prefix }
}

// NewRedisStore returns a RedisStore that uses client. A nil client or an
// unusable option is a wiring mistake, reported as ErrInvalidOption by New
// when the store is given to a Limiter, so that it shows at startup, and
// by every call of a store used on its own.
func NewRedisStore(client redis.UniversalClient, opts ...RedisOption) *RedisStore {
	s := &RedisStore{client: client, prefix: defaultKeyPrefix, script: redisscript.New(scripts.Limit),
		settleScript: redisscript.New(scripts.Settle), random: random53}
	for _, o := range opts {
		o(s)
	}
	switch {
	case client == nil:
		s.err = fmt.Errorf("%w: nil Redis client", ErrInvalidOption)
	case strings.ContainsAny(s.prefix, "{}"):
		s.err = fmt.Errorf("%w: key prefix contains a brace", ErrInvalidOption)
	}
	return s
}

// ScriptLoads returns how many times the store has sent its scripts'
// source after Redis answered NOSCRIPT.
func (s *RedisStore) ScriptLoads() int64 {
	return s.script.Loads() + s.settleScript.Loads() + s.batch.loads()
}

// Take implements Store.
func (s *RedisStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if err := checkTake(key, cost, plans); err != nil {
		return Result{}, err
	}
	return s.take(ctx, key, cost, plans)
}

// take is Take for a request already checked.
func (s *RedisStore) take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if s.err != nil {
		return Result{}, s.err
	}
	return s.run(ctx, s.keys(key, plans), s.args(cost, plans), cost, plans)
}

// run runs the script with keys and args on the state of plans, through
// the batcher if there is one, and describes its decision.
func (s *RedisStore) run(ctx context.Context, keys []string, args []any, cost int64, plans []Plan) (Result, error) {
	reply, err := s.eval(ctx, keys, args)
	if err != nil {
		return Result{}, err
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
		return Result{}, err
	}
	return newResult(plans, buckets, windows, now, cost, allowed, wd), nil
}

// args returns the script's ARGV for a decision (see scripts/limit.lua):
// for buckets alone, the cost and each plan's capacity and rate; with
// windows, the cost, a random number drawn if a plan is suppressed, and
// four numbers per plan.
func (s *RedisStore) args(cost int64, plans []Plan) []any {
	if !windowIn(plans) && !versionedIn(plans) {
		args := make([]any, 1+2*len(plans))
		args[0] = cost
		for i := range plans {
			args[1+2*i], args[2+2*i] = capacityArg(&plans[i]), formatRate(plans[i].Rate)
		}
		return args
	}
	args := make([]any, 2+4*len(plans))
	args[0], args[1] = cost, 0
	if suppressedIn(plans) {
		args[1] = s.random()
	}
	for i := range plans {
		p, a := &plans[i], args[2+4*i:6+4*i]
		switch {
		case !p.isWindow():
			a[0], a[1], a[2], a[3] = capacityArg(p), formatRate(p.Rate), 0, versionArg(p)
		case p.Suppress != 0:
			a[0], a[1], a[2], a[3] = capacityArg(p), p.width(), p.slots(), p.hardLimit()
		default:
			a[0], a[1], a[2], a[3] = capacityArg(p), p.width(), p.slots(), 0
		}
	}
	return args
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
		n += 2
		if p.isWindow() {
			n += 2
		}
	}
	return n
}

// maxWait bounds every wait a reply may tell, in µs: no plan's bucket
// fills, nor its window empties, in longer.
var maxWait = 2 * MaxRefillPeriod.Microseconds()

// parseReply checks the shape of the script's reply instead of trusting it
// (see scripts/limit.lua): all integers, with counts, tokens and stamps
// that Lua's doubles hold exactly, and waits no plan could tell. It puts
// the bucket of bucket plan i in buckets[i], as stored, and the state of
// window plan i in windows[i]. A stamp after now (Redis TIME stepped back)
// or tokens above a capacity that shrank are for Refill to judge, as the
// next decision will.
func parseReply(buckets []TokenBucket, windows []planState, reply any, plans []Plan, cost int64) (allowed bool, now int64, wd uint64, err error) {
	var stack [2 + 4*4]int64
	vals, err := redisscript.Ints(stack[:0], reply, replyLen(plans))
	if err != nil {
		return false, 0, 0, err
	}
	// The allowed bit, then a bit per shadowed plan that would deny.
	if wd = uint64(vals[0]) >> 1; vals[0] < 0 || wd&^shadowMask(plans) != 0 {
		return false, 0, 0, fmt.Errorf("%w: allowed flag is %d", ErrBadReply, vals[0])
	}
	allowed, now = vals[0]&1 == 1, vals[1]
	vals = vals[2:]
	for i := range plans {
		p := &plans[i]
		if !p.isWindow() {
			buckets[i] = TokenBucket{Tokens: vals[0], Stamp: vals[1]}
			vals = vals[2:]
			continue
		}
		admitted, offered, ready, reset := vals[0], vals[1], vals[2], vals[3]
		if ready < now || reset < now || ready-now > maxWait || reset-now > maxWait {
			return false, 0, 0, fmt.Errorf("%w: a window's wait is out of range", ErrBadReply)
		}
		windows[i] = windowState(p, admitted, offered, ready, reset, now, cost, allowed && wd&(1<<i) == 0)
		vals = vals[4:]
	}
	return allowed, now, wd, nil
}

// Reset implements Store: it deletes the buckets, which then read as full.
func (s *RedisStore) Reset(ctx context.Context, key string, plans []Plan) error {
	if s.err != nil {
		return s.err
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if len(plans) == 0 {
		return nil
	}
	return redisscript.Sanitize(s.client.Del(ctx, s.keys(key, plans)...).Err())
}
