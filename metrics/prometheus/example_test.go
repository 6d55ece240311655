package tgprom_test

import (
	"bufio"
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

// A Limiter on Redis, whose Collector is registered and served at
// /metrics. The example runs an embedded miniredis, scrapes its own
// /metrics and prints some of the lines: the third request is denied by
// Redis, and the fourth, the same request again, by the Limiter's memory
// of that denial without a call to Redis.
func Example() {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer mr.Close()
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer client.Close()

	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{{Name: "basic", Capacity: 2, Rate: 1}})
	if err != nil {
		log.Fatal(err)
	}
	reg := prometheus.NewRegistry() // a service would use prometheus.MustRegister
	reg.MustRegister(tgprom.New(lim, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"})))

	for i := 0; i < 4; i++ { // 2 allowed, 2 denied
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
		if strings.HasPrefix(line, "tollgate_decisions_total") && !strings.HasSuffix(line, " 0") ||
			strings.HasPrefix(line, "tollgate_store_duration_seconds_count") ||
			strings.HasPrefix(line, "tollgate_script_loads_total") ||
			strings.HasPrefix(line, "tollgate_fallback_active") {
			fmt.Println(line)
		}
	}
	// Output:
	// tollgate_decisions_total{decision="allowed",limiter="api",plan="basic",source="store"} 2
	// tollgate_decisions_total{decision="denied",limiter="api",plan="basic",source="cache"} 1
	// tollgate_decisions_total{decision="denied",limiter="api",plan="basic",source="store"} 1
	// tollgate_fallback_active{limiter="api"} 0
	// tollgate_script_loads_total{limiter="api"} 1
	// tollgate_store_duration_seconds_count{limiter="api"} 3
}

// Several Limiters in one registry: one Collector each, told apart by a
// const label.
func ExampleWithConstLabels() {
	plans := []tollgate.Plan{{Name: "basic", Capacity: 10, Rate: 1}}
	api, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	if err != nil {
		log.Fatal(err)
	}
	login, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	if err != nil {
		log.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		tgprom.New(api, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"})),
		tgprom.New(login, tgprom.WithConstLabels(prometheus.Labels{"limiter": "login"})),
	)
	_, _ = api.Allow(context.Background(), "user-42")

	mfs, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "tollgate_decisions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if v := m.GetCounter().GetValue(); v > 0 {
				fmt.Println(m.GetLabel()[1].GetValue(), v) // labels sorted by name: decision, limiter, plan, source
			}
		}
	}
	// Output:
	// api 1
}
