package tollgate

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

//go:embed scripts/token_bucket.lua
var tokenBucketLua string

var tokenBucketSHA = func() string {
	sum := sha1.Sum([]byte(tokenBucketLua))
	return hex.EncodeToString(sum[:])
}()

// DefaultKeyPrefix is the default first part of every Redis key.
const DefaultKeyPrefix = "tollgate"

// RedisStore is a Store that keeps buckets in Redis, shared by every
// instance that uses the same Redis and key prefix. It is safe for
// concurrent use.
//
// Each decision is one EVALSHA of an embedded Lua script, atomic across
// every chained plan, with Redis TIME as the only clock. When Redis answers
// NOSCRIPT (after a restart, SCRIPT FLUSH or failover) the store sends the
// script with EVAL, which loads it, and carries on: callers never see it.
//
// It works with every go-redis client: Client, ClusterClient, the failover
// (Sentinel) client and Ring. It needs Redis 5.0 or later, which replicates
// a script's effects rather than the script, so reading TIME before writing
// is allowed; tests run on Redis 7.0.
type RedisStore struct {
	client redis.UniversalClient
	prefix string
	err    error // a bad option, returned by every call
	obs    Observer

	scriptLoads atomic.Int64
}

// RedisOption configures a RedisStore.
type RedisOption func(*RedisStore)

// WithKeyPrefix sets the first part of every Redis key; instances share
// buckets only when they share it. It must not contain '{' or '}', which
// would move the Cluster hash tag. The default is DefaultKeyPrefix.
func WithKeyPrefix(prefix string) RedisOption {
	return func(s *RedisStore) { s.prefix = prefix }
}

// WithRedisObserver sets an Observer of the store's script reloads. Give
// it the Observer given to the Limiter. The default is none.
func WithRedisObserver(o Observer) RedisOption {
	return func(s *RedisStore) { s.obs = o }
}

// NewRedisStore returns a RedisStore that uses client. A bad option, or a
// nil client, is reported by every call of the store as ErrInvalidOption.
func NewRedisStore(client redis.UniversalClient, opts ...RedisOption) *RedisStore {
	s := &RedisStore{client: client, prefix: DefaultKeyPrefix}
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

// ScriptLoads returns how many times the store has reloaded its script
// after Redis answered NOSCRIPT.
func (s *RedisStore) ScriptLoads() int64 {
	return s.scriptLoads.Load()
}

// Take implements Store.
func (s *RedisStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if s.err != nil {
		return Result{}, s.err
	}
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
	args := make([]any, 1+2*len(plans))
	args[0] = cost
	for i, p := range plans {
		keys[i] = s.Key(key, p.Name)
		args[1+2*i] = p.Capacity
		args[2+2*i] = strconv.FormatFloat(p.Rate, 'g', -1, 64) // shortest text that parses back exactly
	}
	reply, err := s.client.EvalSha(ctx, tokenBucketSHA, keys, args...).Result()
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		s.scriptLoads.Add(1)
		if s.obs != nil {
			s.obs.ObserveScriptLoad()
		}
		reply, err = s.client.Eval(ctx, tokenBucketLua, keys, args...).Result()
	}
	if err != nil {
		return Result{}, err
	}
	var stack [4]TokenBucket // up to four plans without allocating
	allowed, now, buckets, err := parseReplyInto(stack[:0], reply, plans)
	if err != nil {
		return Result{}, err
	}
	return newResult(plans, buckets, now, cost, allowed), nil
}

// parseReply checks the shape of the script's reply instead of trusting it:
// {allowed, now, tokens_1, stamp_1, ...}, all integers, with tokens and
// stamps that Lua's doubles hold exactly. The buckets are as stored; a
// stamp after now (Redis TIME stepped back) or tokens above a capacity
// that shrank are for Refill to judge, as the next decision will.
func parseReply(reply any, plans []Plan) (allowed bool, now int64, buckets []TokenBucket, err error) {
	return parseReplyInto(nil, reply, plans)
}

// parseReplyInto is parseReply appending the buckets to dst.
func parseReplyInto(dst []TokenBucket, reply any, plans []Plan) (allowed bool, now int64, buckets []TokenBucket, err error) {
	vals, ok := reply.([]any)
	if !ok || len(vals) != 2+2*len(plans) {
		return false, 0, nil, fmt.Errorf("%w: want an array of %d integers, got %T", ErrBadReply, 2+2*len(plans), reply)
	}
	for i, v := range vals {
		x, ok := v.(int64)
		if !ok {
			return false, 0, nil, fmt.Errorf("%w: element %d is %T, not an integer", ErrBadReply, i, v)
		}
		if x < 0 || x > 1<<53 {
			return false, 0, nil, fmt.Errorf("%w: element %d out of range", ErrBadReply, i)
		}
	}
	flag := vals[0].(int64)
	if flag > 1 {
		return false, 0, nil, fmt.Errorf("%w: allowed flag is %d", ErrBadReply, flag)
	}
	for i := range plans {
		dst = append(dst, TokenBucket{Tokens: vals[2+2*i].(int64), Stamp: vals[3+2*i].(int64)})
	}
	return flag == 1, vals[1].(int64), dst, nil
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
	return s.client.Del(ctx, keys...).Err()
}
