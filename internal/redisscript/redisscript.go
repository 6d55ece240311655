// Package redisscript runs tollgate's embedded Lua scripts: EVALSHA first,
// EVAL when Redis answers NOSCRIPT (after a restart, SCRIPT FLUSH or a
// failover), a check of the reply's shape, and errors that keep their class
// but never the text Redis sent, which can echo a command's arguments and so
// a caller's key. It knows nothing of what the scripts compute.
package redisscript

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// ErrBadReply means a script's reply did not have the expected shape. The
// root package wraps it in what a store returns.
var ErrBadReply = errors.New("tollgate: unexpected reply from Redis")

// Script is a Lua script and its SHA-1. It is safe for concurrent use.
type Script struct {
	src   string
	sha   string
	loads atomic.Int64
}

// New returns the Script of the Lua source src.
func New(src string) *Script {
	sum := sha1.Sum([]byte(src))
	return &Script{src: src, sha: hex.EncodeToString(sum[:])}
}

// SHA returns the script's SHA-1 in hex, as SCRIPT EXISTS takes it.
func (s *Script) SHA() string { return s.sha }

// Loads returns how many times Run has sent the script's source after
// Redis answered NOSCRIPT.
func (s *Script) Loads() int64 { return s.loads.Load() }

// Run runs the script on c with keys and args, and returns its reply.
// Errors Redis answered are replaced by an *Error of the same class;
// network errors and the context's errors are returned as they are.
func (s *Script) Run(ctx context.Context, c redis.Scripter, keys []string, args ...any) (any, error) {
	reply, err := c.EvalSha(ctx, s.sha, keys, args...).Result()
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		s.loads.Add(1)
		reply, err = c.Eval(ctx, s.src, keys, args...).Result()
	}
	if err != nil {
		return nil, failed(err)
	}
	return reply, nil
}

// failed returns the error of a script or function call that failed with
// err: ErrBadReply for a nil reply (the Lua code returned nil or false),
// which go-redis hands over as redis.Nil, else Sanitize's.
func failed(err error) error {
	if errors.Is(err, redis.Nil) {
		return fmt.Errorf("%w: nil", ErrBadReply)
	}
	return Sanitize(err)
}

// Error is an error Redis answered, reduced to its class: the first word of
// the reply, such as "OOM", "READONLY", "NOPERM", "NOSCRIPT", "BUSY",
// "LOADING", "CLUSTERDOWN", "WRONGTYPE" or "ERR". The rest of Redis's text
// is dropped, since it can quote the command's arguments.
type Error struct {
	Class string
}

// Error returns "redis answered " and the class, for example "redis
// answered OOM".
func (e *Error) Error() string { return "redis answered " + e.Class }

// Sanitize replaces an error Redis answered with its class, for any
// command. Errors that did not come from Redis's reply (the network, the
// context, go-redis's own such as a closed client), and redis.Nil, a nil
// reply rather than an error, hold no argument and are kept, so that
// callers can still tell a timeout or a cancellation. nil stays nil.
func Sanitize(err error) error {
	if err == nil {
		return nil
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) || errors.Is(err, redis.Nil) {
		return err
	}
	var nerr net.Error
	if errors.As(err, &nerr) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	msg := rerr.Error()
	class, _, _ := strings.Cut(msg, " ")
	if class == "ERR" && strings.HasPrefix(msg, "ERR Error running script") {
		// Before 7.0, an error a command raised inside a script comes
		// wrapped: "ERR Error running script (call to f_…):
		// @user_script:63: -OOM command not allowed …". Its own class
		// is the word after the last ": -".
		if i := strings.LastIndex(msg, ": -"); i >= 0 {
			class, _, _ = strings.Cut(msg[i+3:], " ")
		}
	}
	if !classes[class] {
		class = "ERR" // anything else may be data, and would be a metric label
	}
	return &Error{Class: class}
}

// classes are the error classes Redis answers with. A reply whose first
// word is another, or an inner class of a wrapped script error that is not
// among them, is reported as ERR: a caller's key quoted in the reply must
// not pass for a class.
var classes = map[string]bool{
	"ERR": true, "WRONGTYPE": true, "OOM": true, "READONLY": true, "NOPERM": true,
	"NOAUTH": true, "WRONGPASS": true, "NOSCRIPT": true, "BUSY": true, "LOADING": true,
	"MASTERDOWN": true, "CLUSTERDOWN": true, "TRYAGAIN": true, "MOVED": true, "ASK": true,
	"CROSSSLOT": true, "MISCONF": true, "NOREPLICAS": true, "EXECABORT": true,
	"BUSYKEY": true, "UNBLOCKED": true, "NOTBUSY": true, "NOPROTO": true,
}

// MaxExact is the largest integer that Lua's doubles, and so a script's
// arithmetic, hold exactly: 2^53.
const MaxExact = 1 << 53

// Ints checks that reply is an array of exactly n integers, each 0 to
// MaxExact, or a Batch's reply of one call that packs them, and appends
// them to dst. Anything else is ErrBadReply, with a message that names
// the shape but never a value.
func Ints(dst []int64, reply any, n int) ([]int64, error) {
	if s, ok := reply.(string); ok {
		return packedInts(dst, s, n)
	}
	vals, ok := reply.([]any)
	if !ok || len(vals) != n {
		return dst, fmt.Errorf("%w: want an array of %d integers, got %T", ErrBadReply, n, reply)
	}
	for i, v := range vals {
		x, ok := v.(int64)
		if !ok {
			return dst, fmt.Errorf("%w: element %d is %T, not an integer", ErrBadReply, i, v)
		}
		if x < 0 || x > MaxExact {
			return dst, fmt.Errorf("%w: element %d out of range", ErrBadReply, i)
		}
		dst = append(dst, x)
	}
	return dst, nil
}
