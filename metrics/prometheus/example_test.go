package tgprom_test

import (
	"bufio"
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

// A Limiter reports to an Observer, whose registry is served at /metrics.
// The example scrapes its own /metrics and prints some of the lines.
func Example() {
	reg := prometheus.NewRegistry()
	obs, err := tgprom.New(reg, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"}))
	if err != nil {
		log.Fatal(err)
	}
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "basic", Capacity: 2, Rate: 1}},
		tollgate.WithObserver(obs))
	if err != nil {
		log.Fatal(err)
	}
	for i := 0; i < 3; i++ { // 2 allowed, 1 denied
		if _, err := lim.Allow(context.Background(), "user-42"); err != nil {
			log.Fatal(err)
		}
	}

	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "tollgate_fallback_active") || strings.HasPrefix(line, "tollgate_breaker_state") ||
			strings.HasPrefix(line, "tollgate_decisions_total") && strings.Contains(line, `source="store"`) {
			fmt.Println(line)
		}
	}
	// Output:
	// tollgate_breaker_state{limiter="api"} 0
	// tollgate_decisions_total{decision="allowed",limiter="api",plan="basic",source="store"} 2
	// tollgate_decisions_total{decision="denied",limiter="api",plan="basic",source="store"} 1
	// tollgate_fallback_active{limiter="api"} 0
}

// Wiring in a service: the same Observer goes to the Limiter and to its
// RedisStore, and the default registry is served at /metrics.
func ExampleNew() {
	obs, err := tgprom.New(prometheus.DefaultRegisterer)
	if err != nil {
		log.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	store := tollgate.NewRedisStore(client, tollgate.WithRedisObserver(obs))
	lim, err := tollgate.New(store, []tollgate.Plan{{Name: "api", Capacity: 20, Rate: 10}},
		tollgate.WithObserver(obs))
	if err != nil {
		log.Fatal(err)
	}
	_ = lim // use lim in handlers

	http.Handle("/metrics", promhttp.Handler())
	// log.Fatal(http.ListenAndServe(":9090", nil))
}
