package redisscript

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Client is what a Function runs on: every go-redis client (Client,
// ClusterClient, the failover client, Ring, the auto-pipeliner) is one.
type Client interface {
	redis.Scripter
	FCall(ctx context.Context, function string, keys []string, args ...any) *redis.Cmd
	FunctionLoadReplace(ctx context.Context, code string) *redis.StringCmd
}

// Entry is one function of a Library: its name, and its body, Lua that
// reads KEYS and ARGV and ends with its return statement, as a script's
// does.
type Entry struct {
	Name, Body string
}

// Library is Lua code that Redis 7.0 and later keep as a library of
// functions (FUNCTION LOAD), whose prelude runs once when the library is
// first called rather than on every call as a script's does. On a server
// without functions (Redis before 7.0, miniredis) each function runs as a
// script of its own, its prelude and its body, with EVALSHA; the store
// learns which at its first call and keeps to it. It is safe for
// concurrent use.
type Library struct {
	code    string      // FUNCTION LOAD's source
	scripts atomic.Bool // the server has no functions: run the scripts
}

// Function is one entry of a Library. It is safe for concurrent use.
type Function struct {
	lib    *Library
	name   string  // FCALL's name: the library's, then the entry's
	script *Script // the same code, for a server without functions
	loads  atomic.Int64
}

// NewLibrary returns the functions of the library named name (letters,
// digits and underscores) of prelude and entries, in their order. Redis
// names a function across all its libraries: each name ends with a hash
// of the library's code, so that two versions of a library, loaded by two
// versions of a program that share one Redis, never replace each other's
// functions.
func NewLibrary(name, prelude string, entries ...Entry) []*Function {
	var b strings.Builder
	b.WriteString("local function init()\n" + prelude + "\nreturn {\n")
	for _, e := range entries {
		b.WriteString("function(KEYS, ARGV)\n" + e.Body + "\nend,\n")
	}
	b.WriteString("}\nend\n")
	sum := sha1.Sum([]byte(b.String()))
	name += "_" + hex.EncodeToString(sum[:6])
	// Redis 7.0 gives a library's top level nothing but redis.register_function
	// and redis.log: the prelude, which reads math, string and struct, runs
	// at the first call of any of its functions, and its functions serve
	// every call after it.
	b.WriteString("local fs\n")
	lib := &Library{}
	fns := make([]*Function, len(entries))
	for i, e := range entries {
		fn := name + "_" + e.Name
		b.WriteString("redis.register_function('" + fn + "', function(keys, args)\n" +
			"  fs = fs or init()\n  return fs[" + strconv.Itoa(i+1) + "](keys, args)\nend)\n")
		fns[i] = &Function{lib: lib, name: fn, script: New(prelude + "\n" + e.Body)}
	}
	lib.code = "#!lua name=" + name + "\n" + b.String()
	return fns
}

// Name returns the name FCALL calls the function by.
func (f *Function) Name() string { return f.name }

// Script returns the script the function runs as on a server without
// functions: the library's prelude, then the function's body.
func (f *Function) Script() *Script { return f.script }

// Loads returns how many times Run has sent the function's library with
// FUNCTION LOAD, or its script with EVAL after NOSCRIPT.
func (f *Function) Loads() int64 { return f.loads.Load() + f.script.Loads() }

// Run runs the function on c with keys and args, and returns its reply:
// with FCALL, loading the library first when Redis does not have it (after
// a restart, FUNCTION FLUSH or a failover to a server without it); as a
// script when the server has no functions. Errors are those Script.Run
// returns.
func (f *Function) Run(ctx context.Context, c Client, keys []string, args ...any) (any, error) {
	if f.lib.scripts.Load() {
		return f.script.Run(ctx, c, keys, args...)
	}
	reply, err := c.FCall(ctx, f.name, keys, args...).Result()
	if err == nil {
		return reply, nil
	}
	switch {
	case noFunctions(err):
		f.lib.scripts.Store(true)
		return f.script.Run(ctx, c, keys, args...)
	case notLoaded(err):
		return f.reload(ctx, c, keys, args)
	case refusedBeforeRunning(err):
		return f.script.Run(ctx, c, keys, args...)
	}
	return nil, failed(err)
}

// reload loads the library on c, for a call that found it missing, and
// runs the call again: with FCALL once the library is loaded, as a script
// if loading failed or it is missing again (flushed once more meanwhile),
// so that the call never fails for want of it.
func (f *Function) reload(ctx context.Context, c Client, keys []string, args []any) (any, error) {
	f.loads.Add(1)
	if err := f.lib.load(ctx, c); err != nil {
		if noFunctions(err) {
			f.lib.scripts.Store(true)
		}
		return f.script.Run(ctx, c, keys, args...)
	}
	reply, err := c.FCall(ctx, f.name, keys, args...).Result()
	if err != nil && (notLoaded(err) || refusedBeforeRunning(err)) {
		return f.script.Run(ctx, c, keys, args...)
	}
	if err != nil {
		return nil, failed(err)
	}
	return reply, nil
}

// load sends the library with FUNCTION LOAD REPLACE: to every master of a
// Cluster and every shard of a Ring, where a call without a key would
// reach only one, and to c itself otherwise.
func (l *Library) load(ctx context.Context, c Client) error {
	each := func(ctx context.Context, node *redis.Client) error {
		return node.FunctionLoadReplace(ctx, l.code).Err()
	}
	switch c := c.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, each)
	case *redis.Ring:
		return c.ForEachShard(ctx, each)
	}
	return c.FunctionLoadReplace(ctx, l.code).Err()
}

// answered returns the text of err if Redis answered it, and "" if not.
func answered(err error) string {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return ""
	}
	return rerr.Error()
}

// notLoaded reports whether Redis answered that it has no function of the
// name called: it lost the library, or never had it.
func notLoaded(err error) bool {
	return answered(err) == "ERR Function not found"
}

// noFunctions reports whether Redis answered that it has no FCALL or
// FUNCTION command, or that this client may not use them: Redis before
// 7.0, miniredis, or an ACL that allows scripts alone.
func noFunctions(err error) bool {
	msg := answered(err)
	if strings.HasPrefix(msg, "NOPERM") {
		return strings.Contains(msg, "'fcall'") || strings.Contains(msg, "'function")
	}
	return strings.HasPrefix(msg, "ERR unknown command")
}

// refusedBeforeRunning reports whether Redis refused to start a function
// that may write, where it starts a script and fails only the script's
// first write: at maxmemory (OOM), on a read-only replica (READONLY), or
// short of the replicas min-replicas-to-write asks (NOREPLICAS). Run as a
// script, a call that writes nothing (a read, a denial) still answers.
func refusedBeforeRunning(err error) bool {
	class, _, _ := strings.Cut(answered(err), " ")
	return class == "OOM" || class == "READONLY" || class == "NOREPLICAS"
}
