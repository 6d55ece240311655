package tgotel_test

import (
	"context"
	"fmt"
	"log"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/tollgate-go/tollgate"
	tgotel "github.com/tollgate-go/tollgate/metrics/otel"
)

// A Limiter's instruments on a MeterProvider. A service would give the
// provider a periodic reader and an exporter (OTLP, Prometheus); the
// example collects by hand, which runs the callback that reads the
// Limiter's Stats.
func Example() {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "basic", Capacity: 2, Rate: 1}})
	if err != nil {
		log.Fatal(err)
	}
	reg, err := tgotel.Register(lim, mp, tgotel.WithAttributes(attribute.String("limiter", "api")))
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Unregister()
	for i := 0; i < 3; i++ { // 2 allowed, 1 denied
		if _, err := lim.Allow(context.Background(), "user-42"); err != nil {
			log.Fatal(err)
		}
	}

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		log.Fatal(err)
	}
	for _, m := range rm.ScopeMetrics[0].Metrics {
		if m.Name != "tollgate.decisions" {
			continue
		}
		for _, d := range []string{"allowed", "denied"} {
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				dec, _ := p.Attributes.Value("decision")
				src, _ := p.Attributes.Value("source")
				if dec.AsString() == d && src.AsString() == "store" {
					fmt.Printf("%s %s: %d\n", m.Name, p.Attributes.Encoded(attribute.DefaultEncoder()), p.Value)
				}
			}
		}
	}
	// Output:
	// tollgate.decisions decision=allowed,limiter=api,plan=basic,source=store: 2
	// tollgate.decisions decision=denied,limiter=api,plan=basic,source=store: 1
}
