// Command tollgate inspects, resets and load-tests tollgate buckets in
// Redis.
//
//	tollgate inspect [-redis URL] [-prefix P] KEY PLAN...
//	tollgate reset   [-redis URL] [-prefix P] KEY PLAN...
//	tollgate bench   [-redis URL] [-duration 10s] [-concurrency 8] [-keys 10000] [-plans NAME:CAPACITY:RATE|WINDOW,...]
//	tollgate breaker show|reset|open|close [-redis URL] [-prefix P] [-window 10s] KEY
//
// Redis is given by -redis, else $REDIS_URL, else redis://127.0.0.1:6379/0.
// The exit status is 0 on success, 1 on a runtime error and 2 on a usage
// error. It prints the keys an operator types, and nothing else of them:
// keys may be personal data.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
)

const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// defaultRedisURL is the Redis used without -redis and $REDIS_URL.
const defaultRedisURL = "redis://127.0.0.1:6379/0"

const usageText = `Usage:
  tollgate inspect [-redis URL] [-prefix P] KEY PLAN...
  tollgate reset   [-redis URL] [-prefix P] KEY PLAN...
  tollgate bench   [-redis URL] [-duration 10s] [-concurrency 8] [-keys 10000]
                   [-plans NAME:CAPACITY:RATE|WINDOW,...] [-progress 1s]
  tollgate breaker show|reset|open|close [-redis URL] [-prefix P] [-window 10s] KEY
  tollgate help

inspect  prints the buckets of KEY for each PLAN as Redis holds them, reading
         only (TYPE, PTTL, GET, HGETALL, TIME): tokens, refill stamp, expiry.
reset    deletes the buckets of KEY for each PLAN; they then read as full.
bench    runs a closed-loop load through the library (RedisStore, Limiter with
         FailClosed), printing decisions/s and errors every second, then
         totals and latency percentiles. Its buckets go under a random key
         prefix and are deleted at the end (they would expire by TTL anyway).
breaker  shows the shared circuit breaker of KEY (state, generation, trips,
         calls in the window), or resets it, or forces it open or closed
         across the fleet; -window is the breakers' Window, for show's counts.

Flags go before KEY. Redis is -redis URL, else $REDIS_URL, else
redis://127.0.0.1:6379/0 (redis://[user:password@]host:port/db; rediss:// for
TLS). The key prefix defaults to "tollgate".

Exit status: 0 ok, 1 runtime error, 2 usage error.
`

// usageError is an error in the command line: exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return usageError{fmt.Sprintf(format, args...)}
}

// libUsageError is a usage error from the library's checks, without its
// "tollgate: " prefix, which run adds.
func libUsageError(err error) error {
	return usageError{strings.TrimPrefix(err.Error(), "tollgate: ")}
}

func main() {
	// go-redis logs every failed dial; the error tollgate prints says it.
	redis.SetLogger(quietLogger{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// run runs the command line args (without the program name), writing
// results to stdout and errors to stderr, and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usageText)
		return exitUsage
	}
	var err error
	switch cmd, rest := args[0], args[1:]; cmd {
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usageText)
		return exitOK
	case "inspect", "reset":
		err = runBucketCommand(ctx, cmd, rest, stdout, stderr, getenv)
	case "bench":
		err = runBench(ctx, rest, stdout, stderr, getenv)
	case "breaker":
		err = runBreakerCommand(ctx, rest, stdout, stderr, getenv)
	default:
		err = usagef("unknown command %q", cmd)
	}
	var ue usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "%s\nRun 'tollgate help' for usage.\n", errorLine(err))
		return exitUsage
	}
	fmt.Fprintln(stderr, errorLine(err))
	return exitError
}

// errorLine returns err as the line the command prints: after "tollgate: ",
// unless the library's own prefix ("tollgate: ", "tollgate/breaker: ")
// begins it already.
func errorLine(err error) string {
	if msg := err.Error(); strings.HasPrefix(msg, "tollgate") {
		return msg
	}
	return "tollgate: " + err.Error()
}

// newFlagSet returns a FlagSet for a subcommand that reports errors as
// usage errors and prints its own synopsis on -h.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args into fs, turning a bad flag into a usage error
// (the flag package has already printed it and the usage).
func parseFlags(fs *flag.FlagSet, args []string) error {
	err := fs.Parse(args)
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		return usageError{err.Error()}
	}
	return err
}

// redisOptions returns the options of the Redis named by the -redis flag,
// else $REDIS_URL, else defaultRedisURL.
func redisOptions(flagURL string, getenv func(string) string) (*redis.Options, error) {
	u := flagURL
	if u == "" {
		u = getenv("REDIS_URL")
	}
	if u == "" {
		u = defaultRedisURL
	}
	opts, err := redis.ParseURL(u)
	if err != nil {
		return nil, usagef("bad Redis URL: %v", urlError(u, err))
	}
	opts.DialerRetries = 1 // go-redis otherwise dials 5 times, 100 ms apart
	return opts, nil
}

// urlError returns err, the error of parsing the Redis URL u, without the
// URL's user name and password. A *url.Error quotes the whole URL, and
// the error it wraps may quote part of it: a password holding '/', '?'
// or '#' ends the host early, and net/url quotes the rest of the password
// as a bad port. So the error of a URL with a user part is that of the
// URL without it, or, if that parses, a fixed text.
func urlError(u string, err error) error {
	ue := (*url.Error)(nil)
	if !errors.As(err, &ue) {
		return err // go-redis's own, which quote no password
	}
	scheme, rest, ok := strings.Cut(u, "://")
	at := strings.LastIndexByte(rest, '@')
	if !ok || at < 0 {
		return ue.Err
	}
	if _, err := url.Parse(scheme + "://" + rest[at+1:]); errors.As(err, &ue) {
		return ue.Err
	}
	return errors.New("the user name or password does not parse: percent-encode '/', '?', '#', '%' and spaces in them")
}

// checkBucketArgs checks what inspect and reset are given, with the
// library's own rules, before anything reaches Redis.
func checkBucketArgs(prefix, key string, plans []string) error {
	if key == "" {
		return usagef("KEY is empty")
	}
	// Flags end at KEY, so "reset alice -prefix staging gold" would act on
	// the default prefix with plans "-prefix" and "staging": refuse it.
	for _, a := range plans {
		if strings.HasPrefix(a, "-") {
			return usagef("flag-like argument %q after KEY: flags go before KEY", a)
		}
	}
	if len(key) > tollgate.MaxKeyLen {
		return usagef("KEY is %d bytes, longer than %d", len(key), tollgate.MaxKeyLen)
	}
	if prefix == "" || strings.ContainsAny(prefix, "{}") {
		return usagef("-prefix must be non-empty, without '{' or '}'")
	}
	ps := make([]tollgate.Plan, len(plans))
	for i, name := range plans {
		ps[i] = tollgate.Plan{Name: name, Capacity: 1, Rate: 1}
	}
	// New checks plan names (and duplicates) as every Limiter does.
	if _, err := tollgate.New(tollgate.NewMemoryStore(), ps); err != nil {
		return libUsageError(err)
	}
	return nil
}

// runBucketCommand runs inspect or reset.
func runBucketCommand(ctx context.Context, cmd string, args []string, stdout, stderr io.Writer, getenv func(string) string) error {
	fs := newFlagSet(cmd, "tollgate "+cmd+" [-redis URL] [-prefix P] KEY PLAN...", stderr)
	redisURL := fs.String("redis", "", "Redis `URL` (default $REDIS_URL, else "+defaultRedisURL+")")
	prefix := fs.String("prefix", "tollgate", "key `prefix` of the buckets, as given to WithKeyPrefix")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() < 2 {
		return usagef("%s needs KEY and at least one PLAN", cmd)
	}
	key, plans := fs.Arg(0), fs.Args()[1:]
	if err := checkBucketArgs(*prefix, key, plans); err != nil {
		return err
	}
	opts, err := redisOptions(*redisURL, getenv)
	if err != nil {
		return err
	}
	client := redis.NewClient(opts)
	defer client.Close()
	if cmd == "inspect" {
		return inspect(ctx, stdout, client, *prefix, key, plans)
	}
	return reset(ctx, stdout, client, *prefix, key, plans)
}
