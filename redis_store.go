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
	client redis.UniversalClient
	prefix string
	err    error // a wiring mistake: New reports it, and so does every call
	script *redisscript.Script
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
	s := &RedisStore{client: client, prefix: defaultKeyPrefix, script: redisscript.New(scripts.TokenBucket)}
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

// ScriptLoads returns how many times the store has sent its script's
// source after Redis answered NOSCRIPT.
func (s *RedisStore) ScriptLoads() int64 {
	return s.script.Loads()
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
	keys := make([]string, len(plans))
	for i, p := range plans {
		keys[i] = s.Key(key, p.Name)
	}
	return s.run(ctx, keys, cost, plans)
}

// run runs the script on the buckets at keys, one per plan.
func (s *RedisStore) run(ctx context.Context, keys []string, cost int64, plans []Plan) (Result, error) {
	args := make([]any, 1+2*len(plans))
	args[0] = cost
	for i, p := range plans {
		args[1+2*i] = p.Capacity
		args[2+2*i] = formatRate(p.Rate)
	}
	reply, err := s.script.Run(ctx, s.client, keys, args...)
	if err != nil {
		return Result{}, err
	}
	var stack [4]TokenBucket // up to four plans without allocating
	allowed, now, buckets, err := parseReply(stack[:0], reply, plans)
	if err != nil {
		return Result{}, err
	}
	return newResult(plans, buckets, now, cost, allowed), nil
}

// formatRate writes a rate as the shortest decimal that parses back to it
// exactly, never in exponent form: gopher-lua's tonumber, which miniredis
// runs, reads "1e-05" as nil.
func formatRate(rate float64) string {
	return strconv.FormatFloat(rate, 'f', -1, 64)
}

// parseReply checks the shape of the script's reply instead of trusting it:
// {allowed, now, tokens_1, stamp_1, ...}, all integers, with tokens and
// stamps that Lua's doubles hold exactly, and appends the buckets to dst.
// The buckets are as stored; a stamp after now (Redis TIME stepped back)
// or tokens above a capacity that shrank are for Refill to judge, as the
// next decision will.
func parseReply(dst []TokenBucket, reply any, plans []Plan) (allowed bool, now int64, buckets []TokenBucket, err error) {
	var stack [2 + 2*4]int64
	vals, err := redisscript.Ints(stack[:0], reply, 2+2*len(plans))
	if err != nil {
		return false, 0, nil, err
	}
	if vals[0] > 1 {
		return false, 0, nil, fmt.Errorf("%w: allowed flag is %d", ErrBadReply, vals[0])
	}
	for i := range plans {
		dst = append(dst, TokenBucket{Tokens: vals[2+2*i], Stamp: vals[3+2*i]})
	}
	return vals[0] == 1, vals[1], dst, nil
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
	keys := make([]string, len(plans))
	for i, p := range plans {
		keys[i] = s.Key(key, p.Name)
	}
	return redisscript.Sanitize(s.client.Del(ctx, keys...).Err())
}
