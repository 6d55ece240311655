// Command http serves a small API behind tollgate's HTTP middleware
// (package httplimit) and shows a client being limited: it starts the
// server on a loopback port, sends a burst of requests to it, prints each
// answer's status and rate limit header fields, then the tollgate metrics
// from its /metrics endpoint, and exits. With -serve it keeps serving
// until interrupted.
//
// It is a module of its own, so that Prometheus reaches only its go.sum,
// never the library's. From the repository root:
//
//	cd examples/http && go run .                      # embedded miniredis
//	cd examples/http && REDIS_URL=redis://localhost:6379/0 go run .
//	cd examples/http && go run . -serve -addr 127.0.0.1:8080
//
// Each run uses a fresh API key, so runs against a real Redis do not
// inherit each other's buckets; those expire on their own once full.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/httplimit"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on")
	burst := flag.Int("n", 8, "requests in the demonstration burst")
	serve := flag.Bool("serve", false, "keep serving after the burst, until interrupted")
	flag.Parse()
	if err := run(*addr, *burst, *serve); err != nil {
		log.Fatal(err)
	}
}

func run(addr string, burst int, serve bool) error {
	client, where, stop, err := newRedis()
	if err != nil {
		return err
	}
	defer stop()

	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{
		{Name: "burst", Capacity: 5, Rate: 1},
		{Name: "daily", Capacity: 1000, Rate: tollgate.Per(1000, 24*time.Hour)},
	})
	if err != nil {
		return err
	}
	checkCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := lim.Check(checkCtx); err != nil { // a wrong password fails here, not as a silent fallback
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(tgprom.New(lim))
	limit := httplimit.Middleware(lim, httplimit.ByHeader("X-API-Key"), httplimit.WithPlans("burst", "daily"))

	mux := http.NewServeMux()
	mux.Handle("GET /items/{id}", limit(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "item %s\n", r.PathValue("id"))
	})))
	// Outside the limiter: scrapes neither spend tokens nor get limited.
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	base := "http://" + ln.Addr().String()
	fmt.Printf("serving on %s, buckets in %s\n\n", base, where)

	if err := demo(base, burst); err != nil {
		return err
	}
	if err := showMetrics(base); err != nil {
		return err
	}

	if serve {
		fmt.Printf("\nserving until interrupted; try:\n  curl -i -H 'X-API-Key: me' %s/items/1\n", base)
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		select {
		case <-ctx.Done():
		case err := <-served:
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		return err
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// newRedis connects to REDIS_URL, or starts an embedded miniredis when it
// is not set. It says which in where; stop closes the client, and stops
// the miniredis.
func newRedis() (client *redis.Client, where string, stop func(), err error) {
	if url := os.Getenv("REDIS_URL"); url != "" {
		opts, err := redis.ParseURL(url)
		if err != nil {
			return nil, "", nil, fmt.Errorf("REDIS_URL: %w", err)
		}
		client = redis.NewClient(opts)
		return client, "Redis at " + opts.Addr, func() { _ = client.Close() }, nil
	}
	mr, err := miniredis.Run()
	if err != nil {
		return nil, "", nil, err
	}
	client = redis.NewClient(&redis.Options{Addr: mr.Addr()})
	stop = func() {
		_ = client.Close()
		mr.Close()
	}
	return client, "an embedded miniredis (set REDIS_URL to use Redis)", stop, nil
}

// demo sends n requests with one fresh API key, as fast as it can, and
// prints what came back.
func demo(base string, n int) error {
	apiKey := "demo-" + rand.Text()[:8]
	hc := &http.Client{Timeout: 5 * time.Second}
	for i := 1; i <= n; i++ {
		req, err := http.NewRequest("GET", fmt.Sprintf("%s/items/%d", base, i), nil)
		if err != nil {
			return err
		}
		req.Header.Set("X-API-Key", apiKey)
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()

		fmt.Printf("GET /items/%d: %s\n", i, resp.Status)
		for _, name := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After"} {
			if v := resp.Header.Get(name); v != "" {
				fmt.Printf("  %s: %s\n", name, v)
			}
		}
	}
	return nil
}

// showMetrics prints the tollgate series from the /metrics endpoint.
func showMetrics(base string) error {
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	fmt.Printf("\nGET /metrics (tollgate series):\n")
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "tollgate_") && !strings.HasPrefix(line, "tollgate_store_duration_seconds_bucket") {
			fmt.Println("  " + line)
		}
	}
	return nil
}
