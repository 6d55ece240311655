package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/breaker"
)

// breakerActions are the subcommands of "tollgate breaker".
var breakerActions = map[string]bool{"show": true, "reset": true, "open": true, "close": true}

// runBreakerCommand runs "tollgate breaker ACTION [flags] KEY": show a
// shared circuit breaker, reset it, or force it open or closed.
func runBreakerCommand(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) error {
	if len(args) == 0 || !breakerActions[args[0]] {
		return usagef("breaker needs an action: show, reset, open or close")
	}
	action := args[0]
	fs := newFlagSet("breaker "+action, "tollgate breaker "+action+" [-redis URL] [-prefix P] [-window 10s] KEY", stderr)
	redisURL := fs.String("redis", "", "Redis `URL` (default $REDIS_URL, else "+defaultRedisURL+")")
	prefix := fs.String("prefix", "tollgate", "key `prefix` of the breakers, as given to breaker.WithPrefix")
	window := fs.Duration("window", 10*time.Second, "the breakers' SharedSettings.Window, over which show counts calls")
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return usagef("breaker %s needs exactly one KEY, after the flags", action)
	}
	key := fs.Arg(0)
	if key == "" || len(key) > breaker.MaxKeyLen {
		return usagef("KEY must be 1 to %d bytes", breaker.MaxKeyLen)
	}
	opts, err := redisOptions(*redisURL, getenv)
	if err != nil {
		return err
	}
	client := redis.NewClient(opts)
	defer client.Close()
	b, err := breaker.NewShared(client, breaker.SharedSettings{Window: *window}, breaker.WithPrefix(*prefix),
		breaker.WithFailurePolicy(breaker.FailClosed), breaker.WithLogger(nil))
	if err != nil {
		return usageError{strings.TrimPrefix(err.Error(), "tollgate/breaker: ")}
	}
	switch action {
	case "reset":
		err = b.Reset(ctx, key)
	case "open":
		err = b.ForceOpen(ctx, key)
	case "close":
		err = b.ForceClosed(ctx, key)
	}
	if err != nil {
		return err
	}
	snap, err := b.Inspect(ctx, key)
	foreign := errors.Is(err, breaker.ErrForeignValue)
	if err != nil && !foreign {
		return err // nothing on stdout: errors go to stderr alone
	}
	fmt.Fprintf(stdout, "%s\n", strconv.Quote(b.Key(key)))
	if foreign {
		fmt.Fprintln(stdout, "  foreign data at this key: reads as closed; the next call or admin action replaces it")
		return nil
	}
	printSnapshot(stdout, snap)
	return nil
}

// printSnapshot prints a breaker's state and counts.
func printSnapshot(w io.Writer, s breaker.Snapshot) {
	state := s.State.String()
	switch {
	case s.Forced:
		state += " (forced: until 'tollgate breaker close' or 'reset')"
	case s.State == breaker.Open && s.RetryAfter > 0:
		state += fmt.Sprintf(" (probes in %v)", s.RetryAfter)
	case s.State == breaker.Open:
		state += " (open time over: the next call probes)"
	}
	fmt.Fprintf(w, "  state       %s\n", state)
	fmt.Fprintf(w, "  generation  %d\n", s.Generation)
	fmt.Fprintf(w, "  trips       %d\n", s.Trips)
	fmt.Fprintf(w, "  window      %d calls, %d failed, %d slow\n", s.Calls, s.Failures, s.Slow)
}
