// Command http measures rate-limiting middleware over real HTTP: the
// README's complete program (tollgate's httplimit on NewRedisStore, with
// the README's client settings), variants of its store options,
// ulule/limiter's net/http middleware on its Redis store, and no limiter
// at all, each serving HTTP/1.1 on loopback to a closed loop of keep-alive
// clients.
//
//	go run ./cmd/http -duration 5s -rounds 5
//
// It starts its own redis-server on a free loopback port (redis-server
// must be on PATH) unless -redis names a Redis; all contenders share it.
//
// Each contender's server runs in a child process, this program run again
// with -serve, so that the server's scheduler and garbage collector hold
// the server alone, as in a deployment. The clients run in this process
// and share the machine's cores with the server and Redis, the same for
// every contender. Each client keeps one connection, writes prebuilt
// requests and parses only the status line and headers of the response,
// to leave the server as much CPU as it can.
//
// Requests come from -keys client identities, each an IPv4 address in
// X-Forwarded-For, which both middlewares trust from loopback, so that
// both limit per the same identities. The limit is one that no run
// reaches (-limit, for checking that the limiters limit, sets another),
// so that every request does the full work of an admission.
//
// Each round runs every contender once, in an order rotated each round.
// The report gives per contender the median requests per second with
// their range, the medians of each round's p50 and p99 latency, and the
// median of each round's ratio to ulule with its range, and counts the
// requests refused and failed and the store calls failed. A run exits
// non-zero, its figures not measuring the limiters' work, if a contender
// answered nothing, if a limit that no run reaches refused a request, or
// if more than 1 in 1000 of a contender's requests failed or met a store
// failure: a failure answered quickly, or a fallback decision made
// without Redis, costs less than a decision. Fewer are timeouts of a busy
// machine, and reported only.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	ulule "github.com/ulule/limiter/v3"
	"github.com/ulule/limiter/v3/drivers/middleware/stdlib"
	ululeredis "github.com/ulule/limiter/v3/drivers/store/redis"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/httplimit"
)

const (
	// unreachable is the default limit, in requests per identity at
	// once: more than any run sends.
	unreachable = 1 << 30
	// perSec is tollgate's refill, in tokens per second: slow, so that a
	// bucket is never full again between visits and every request reads,
	// refills and writes it.
	perSec = 1
	// base is the contender each round's ratio is to.
	base = "ulule"
	// tolerated is the number of requests in which one may fail, or
	// meet a store failure, before a run is rejected.
	tolerated = 1000
	// childEnv marks a contender's server process for a test binary,
	// whose TestMain must hand it to main.
	childEnv = "TOLLGATE_HTTPBENCH_CHILD"
)

// A contender is one way of limiting the benchmark's endpoint.
type contender struct {
	name string
	wrap wrapper
}

// A wrapper returns next limited to limit requests per identity, on the
// Redis client c, and a function that returns the number of store calls
// that have failed so far. ctx bounds its checks of Redis.
type wrapper func(ctx context.Context, c *redis.Client, next http.Handler, limit int64) (http.Handler, func() uint64, error)

// contenders are all there are, in their default order. A variant of
// tollgate's store options takes one line: tollgateWith(options...).
var contenders = []contender{
	{"none", unlimited},
	{"tollgate", tollgateWith()},
	{"tollgate-unbatched", tollgateWith(tollgate.WithoutBatching())},
	{"ulule", ululeLimited},
}

// config is what the flags set.
type config struct {
	redisURL string        // the Redis; empty starts a redis-server
	duration time.Duration // of each contender's run in a round
	rounds   int
	clients  int   // concurrent connections
	keys     int   // client identities
	limit    int64 // requests per identity a limiter admits at once
	only     []string
	serve    string    // the contender a child process serves
	logs     io.Writer // where the servers' logs go; nil discards them
}

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		log.Fatal(err)
	}
	cfg.logs = os.Stderr
	if cfg.serve != "" {
		err = serve(cfg)
	} else {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
		err = run(ctx, cfg, os.Stdout)
		stop()
	}
	if err != nil {
		log.Fatal(err)
	}
}

// parseFlags reads the command line.
func parseFlags(args []string) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("http", flag.ExitOnError)
	fs.StringVar(&cfg.redisURL, "redis", "", "Redis URL; empty starts a redis-server on a free loopback port")
	fs.DurationVar(&cfg.duration, "duration", 5*time.Second, "how long each contender runs in each round")
	fs.IntVar(&cfg.rounds, "rounds", 3, "rounds; medians are reported")
	fs.IntVar(&cfg.clients, "clients", 64, "concurrent keep-alive clients")
	fs.IntVar(&cfg.keys, "keys", 10_000, "client identities (X-Forwarded-For addresses), 1 to 2^24")
	fs.Int64Var(&cfg.limit, "limit", unreachable, "requests per identity a limiter admits at once")
	only := fs.String("only", "", "comma-separated contenders to run (default all)")
	fs.StringVar(&cfg.serve, "serve", "", "serve this contender (the harness's child process)")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if *only != "" {
		cfg.only = strings.Split(*only, ",")
	}
	if cfg.rounds < 1 || cfg.clients < 1 || cfg.keys < 1 || cfg.keys > 1<<24 || cfg.limit < 1 {
		return config{}, errors.New("-rounds, -clients, -keys and -limit must be positive, -keys at most 2^24")
	}
	return cfg, nil
}

// pick returns the contenders named, in their default order, or all of
// them if names is empty.
func pick(names []string) ([]contender, error) {
	for _, n := range names {
		if !slices.ContainsFunc(contenders, func(c contender) bool { return c.name == n }) {
			return nil, fmt.Errorf("no contender %q", n)
		}
	}
	var active []contender
	for _, c := range contenders {
		if len(names) == 0 || slices.Contains(names, c.name) {
			active = append(active, c)
		}
	}
	return active, nil
}

// quickStartOptions returns the client settings of the README's complete
// program for the Redis at url: short timeouts and no retries.
func quickStartOptions(url string) (*redis.Options, error) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opts.DialTimeout = 100 * time.Millisecond
	opts.ReadTimeout = 100 * time.Millisecond
	opts.WriteTimeout = 100 * time.Millisecond
	opts.PoolTimeout = 100 * time.Millisecond
	opts.MaxRetries = -1
	opts.DialerRetries = 1
	opts.ContextTimeoutEnabled = true
	return opts, nil
}

// hello is the README's complete program's handler.
func hello() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello")
	})
	return mux
}

// unlimited serves next as it is: the ceiling.
func unlimited(_ context.Context, _ *redis.Client, next http.Handler, _ int64) (http.Handler, func() uint64, error) {
	return next, func() uint64 { return 0 }, nil
}

// tollgateWith returns the README's complete program's limiter, with opts
// given to NewRedisStore, its plan's capacity limit and its refill
// perSec. ByIP trusts X-Forwarded-For from loopback, where the clients
// connect from.
func tollgateWith(opts ...tollgate.Option) wrapper {
	return func(ctx context.Context, c *redis.Client, next http.Handler, limit int64) (http.Handler, func() uint64, error) {
		lim, err := tollgate.New(tollgate.NewRedisStore(c, opts...), []tollgate.Plan{
			{Name: "per-ip", Capacity: limit, Rate: perSec},
		})
		if err != nil {
			return nil, nil, err
		}
		if err := lim.Check(ctx); err != nil {
			return nil, nil, err
		}
		failures := func() uint64 {
			var n uint64
			for _, v := range lim.Stats().StoreErrors {
				n += v
			}
			return n
		}
		key := httplimit.ByIP(netip.MustParsePrefix("127.0.0.0/8"))
		return httplimit.Middleware(lim, key)(next), failures, nil
	}
}

// ululeLimited is ulule/limiter's net/http middleware on its Redis store
// with their defaults, admitting limit requests per identity in each
// second, and keying by the first address in X-Forwarded-For. A store
// error answers 500 rather than ulule's default panic.
func ululeLimited(ctx context.Context, c *redis.Client, next http.Handler, limit int64) (http.Handler, func() uint64, error) {
	store, err := ululeredis.NewStore(c)
	if err != nil {
		return nil, nil, err
	}
	if err := c.Ping(ctx).Err(); err != nil {
		return nil, nil, err
	}
	l := ulule.New(store, ulule.Rate{Period: time.Second, Limit: limit}, ulule.WithTrustForwardHeader(true))
	var failed atomic.Uint64
	onError := func(w http.ResponseWriter, r *http.Request, err error) {
		failed.Add(1)
		http.Error(w, "rate limiter failed", http.StatusInternalServerError)
	}
	return stdlib.NewMiddleware(l, stdlib.WithErrorHandler(onError)).Handler(next), failed.Load, nil
}

// serve is a contender's server process: it serves cfg.serve on a free
// loopback port and writes the port's address as its first line of
// output; when its input closes it stops, and writes the number of
// store calls that failed.
func serve(cfg config) error {
	active, err := pick([]string{cfg.serve})
	if err != nil {
		return err
	}
	opts, err := quickStartOptions(cfg.redisURL)
	if err != nil {
		return err
	}
	client := redis.NewClient(opts)
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	h, failures, err := active[0].wrap(ctx, client, hello(), cfg.limit)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(ln)
	fmt.Println(ln.Addr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = srv.Close()
	fmt.Println(failures())
	return nil
}

// A server is a contender's server process.
type server struct {
	cmd    *exec.Cmd
	stdin  io.Closer
	out    *bufio.Reader
	stderr bytes.Buffer // what it logged, to be read once it has exited
	logs   io.Writer    // where stop passes stderr on
	addr   string
}

// startServer starts the process that serves the contender name.
func startServer(name string, cfg config) (*server, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-serve", name, "-redis", cfg.redisURL, "-limit", strconv.FormatInt(cfg.limit, 10))
	cmd.Env = append(os.Environ(), childEnv+"=1")
	s := &server{cmd: cmd, logs: cfg.logs}
	cmd.Stderr = &s.stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s.stdin, s.out = stdin, bufio.NewReader(stdout)
	addr, err := s.out.ReadString('\n')
	if err != nil {
		_ = stdin.Close()
		return nil, fmt.Errorf("%s did not start: %v: %s", name, cmd.Wait(), bytes.TrimSpace(s.stderr.Bytes()))
	}
	s.addr = strings.TrimSpace(addr)
	return s, nil
}

// stop stops the server, passes on the first lines it logged, and
// returns the number of store calls that failed in it.
func (s *server) stop() (uint64, error) {
	_ = s.stdin.Close()
	line, readErr := s.out.ReadString('\n')
	err := s.cmd.Wait()
	if s.logs != nil {
		_, _ = io.WriteString(s.logs, head(s.stderr.String(), 20))
	}
	if err != nil {
		return 0, err
	}
	if readErr != nil {
		return 0, readErr
	}
	return strconv.ParseUint(strings.TrimSpace(line), 10, 64)
}

// head returns the first n lines of text, and how many it leaves out.
func head(text string, n int) string {
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) <= n {
		return text
	}
	return fmt.Sprintf("%s\n(and %d more lines)\n", strings.Join(lines[:n], "\n"), len(lines)-n)
}

// requests returns, for each of n client identities, a GET request in
// HTTP/1.1's wire form whose X-Forwarded-For is the identity's address,
// 10.x.y.z.
func requests(n int) [][]byte {
	reqs := make([][]byte, n)
	for i := range reqs {
		ip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		reqs[i] = []byte("GET / HTTP/1.1\r\nHost: bench\r\nX-Forwarded-For: " + ip.String() + "\r\n\r\n")
	}
	return reqs
}

// A tally is what clients saw.
type tally struct {
	latencies []time.Duration // of every request, answered or not
	ok        int64           // 200s
	limited   int64           // 429s
	failed    int64           // other statuses, and requests without an answer
}

// add adds u to t.
func (t *tally) add(u tally) {
	t.latencies = append(t.latencies, u.latencies...)
	t.ok += u.ok
	t.limited += u.limited
	t.failed += u.failed
}

// A result is one contender's run in one round.
type result struct {
	tally
	rate          float64 // requests answered per second
	storeFailures uint64  // store calls that failed, counted by the server
}

// drive runs clients connections to addr for d, each sending reqs in turn,
// one at a time, from a place of its own in reqs.
func drive(ctx context.Context, addr string, reqs [][]byte, clients int, d time.Duration) result {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	tallies := make([]tally, clients)
	var wg sync.WaitGroup
	start := time.Now()
	for g := range tallies {
		wg.Go(func() { tallies[g] = client(ctx, addr, reqs, g*7919) })
	}
	wg.Wait()
	elapsed := time.Since(start)
	var r result
	for _, t := range tallies {
		r.add(t)
	}
	slices.Sort(r.latencies)
	r.rate = float64(r.ok+r.limited) / elapsed.Seconds()
	return r
}

// client sends reqs to addr one at a time on one keep-alive connection,
// from reqs[first] on, until ctx ends. A connection that fails is
// replaced; one that cannot be made ends the client.
func client(ctx context.Context, addr string, reqs [][]byte, first int) tally {
	var t tally
	var conn net.Conn
	var br *bufio.Reader
	for i := first; ctx.Err() == nil; i++ {
		if conn == nil {
			var err error
			if conn, err = dial(ctx, addr); err != nil {
				t.failed++
				return t
			}
			br = bufio.NewReader(conn)
		}
		begin := time.Now()
		status, err := roundTrip(conn, br, reqs[i%len(reqs)])
		t.latencies = append(t.latencies, time.Since(begin))
		switch {
		case err != nil:
			t.failed++
			_ = conn.Close()
			conn = nil
		case status == http.StatusOK:
			t.ok++
		case status == http.StatusTooManyRequests:
			t.limited++
		default:
			t.failed++
		}
	}
	if conn != nil {
		_ = conn.Close()
	}
	return t
}

// dial connects to addr, with a deadline a little past ctx's so that a
// server that hangs cannot hold a client.
func dial(ctx context.Context, addr string) (net.Conn, error) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	deadline, _ := ctx.Deadline()
	return conn, conn.SetDeadline(deadline.Add(10 * time.Second))
}

// roundTrip writes req on conn and reads the response's status from br,
// discarding its body.
func roundTrip(conn net.Conn, br *bufio.Reader, req []byte) (int, error) {
	if _, err := conn.Write(req); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, err
}

// measure serves ct in a process of its own and drives it for one round.
func measure(ctx context.Context, ct contender, cfg config, reqs [][]byte) (result, error) {
	s, err := startServer(ct.name, cfg)
	if err != nil {
		return result{}, err
	}
	r := drive(ctx, s.addr, reqs, cfg.clients, cfg.duration)
	r.storeFailures, err = s.stop()
	if err == nil {
		err = ctx.Err()
	}
	return r, err
}

// measureRounds measures each of active in cfg.rounds rounds, in an order
// rotated each round so that the machine's drift spreads evenly. It
// returns the results by contender, then round.
func measureRounds(ctx context.Context, active []contender, cfg config) ([][]result, error) {
	reqs := requests(cfg.keys)
	results := make([][]result, len(active))
	for round := range cfg.rounds {
		for k := range active {
			i := (k + round) % len(active)
			r, err := measure(ctx, active[i], cfg, reqs)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", active[i].name, err)
			}
			results[i] = append(results[i], r)
		}
	}
	return results, nil
}

// run measures the contenders cfg names, on cfg's Redis or on a
// redis-server of its own, and writes the report to w.
func run(ctx context.Context, cfg config, w io.Writer) error {
	active, err := pick(cfg.only)
	if err != nil {
		return err
	}
	if cfg.redisURL == "" {
		url, stop, err := startRedis()
		if err != nil {
			return err
		}
		defer stop()
		cfg.redisURL = url
	}
	results, err := measureRounds(ctx, active, cfg)
	if err != nil {
		return err
	}
	report(w, active, results)
	return check(active, results, cfg.limit)
}

// check returns an error naming the first contender whose runs answered
// no request, failed or met store failures in more than 1 in tolerated of
// their requests, or, under a limit that no run reaches, refused a request.
func check(active []contender, results [][]result, limit int64) error {
	for i, c := range active {
		t, storeFailures := total(results[i])
		refused := t.limited
		if limit < unreachable {
			refused = 0
		}
		requests := t.ok + t.limited + t.failed
		failures := t.failed + int64(storeFailures)
		if failures*tolerated > requests || refused > 0 || t.ok == 0 {
			return fmt.Errorf("%s: %d requests answered 200, %d refused, %d failed, %d store calls failed: the figures would not measure its work",
				c.name, t.ok, t.limited, t.failed, storeFailures)
		}
	}
	return nil
}

// total returns the tallies of rs added up, and their store failures.
func total(rs []result) (tally, uint64) {
	var t tally
	var storeFailures uint64
	for _, r := range rs {
		t.add(r.tally)
		storeFailures += r.storeFailures
	}
	return t, storeFailures
}

// report writes a line per contender: the medians over the rounds of its
// requests per second (with their range), of its p50 and p99 latency and
// of its ratio to base (with their range), and the refused and failed
// requests and store calls of all rounds.
func report(w io.Writer, active []contender, results [][]result) {
	const format = "%-18s %26s %9s %9s %20s %9v %7v %13v\n"
	fmt.Fprintf(w, format, "contender", "requests/s (range)", "p50", "p99", "× "+base+" (range)", "429s", "failed", "store-failed")
	b := slices.IndexFunc(active, func(c contender) bool { return c.name == base })
	for i, c := range active {
		rs := results[i]
		vs := ""
		if b >= 0 {
			vs = spread(ratios(rs, results[b]), "%.2f")
		}
		t, storeFailures := total(rs)
		rate := spread(each(rs, func(r result) float64 { return r.rate }), "%.0f")
		fmt.Fprintf(w, format, c.name, rate, latency(rs, 0.50), latency(rs, 0.99), vs, t.limited, t.failed, storeFailures)
	}
}

// ratios returns each round's rate of rs over that of base.
func ratios(rs, base []result) []float64 {
	v := make([]float64, len(rs))
	for k := range rs {
		v[k] = rs[k].rate / base[k].rate
	}
	return v
}

// latency returns the median over rs of each round's latency at quantile q.
func latency(rs []result, q float64) time.Duration {
	d := median(each(rs, func(r result) float64 {
		if len(r.latencies) == 0 {
			return 0
		}
		return float64(r.latencies[int(q*float64(len(r.latencies)-1))])
	}))
	return time.Duration(d).Round(time.Microsecond)
}

// each returns f of each of rs.
func each(rs []result, f func(result) float64) []float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	return v
}

// spread formats the median of v and its range, each number in format.
func spread(v []float64, format string) string {
	return fmt.Sprintf(format+" ("+format+"–"+format+")", median(v), slices.Min(v), slices.Max(v))
}

// median returns the middle value of v, the upper one of an even count.
func median(v []float64) float64 {
	s := slices.Sorted(slices.Values(v))
	return s[len(s)/2]
}

// startRedis starts an empty redis-server, saving nothing, on a free
// loopback port, and returns its URL and a function that stops it.
func startRedis() (string, func(), error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	addr := l.Addr().String()
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	_ = l.Close()
	cmd := exec.Command("redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	if err := cmd.Start(); err != nil {
		return "", nil, fmt.Errorf("without -redis, redis-server must be on PATH: %w", err)
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	if err := awaitListener(addr); err != nil {
		stop()
		return "", nil, err
	}
	return "redis://" + addr + "/0", stop, nil
}

// awaitListener waits up to 10 s for addr to accept a connection.
func awaitListener(addr string) error {
	for range 1000 {
		if conn, err := net.Dial("tcp", addr); err == nil {
			return conn.Close()
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("redis-server did not listen on %s", addr)
}
