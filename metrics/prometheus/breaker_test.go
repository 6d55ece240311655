package tgprom_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

func TestBreakerCollector(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	b, err := breaker.NewShared(c, breaker.SharedSettings{MinCalls: 2, OpenFor: time.Minute}, breaker.WithLogger(nil))
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(tgprom.NewBreaker(b)))
	ctx := context.Background()
	for range 2 {
		tk, err := b.Acquire(ctx, "secret@example.com")
		require.NoError(t, err)
		require.NoError(t, tk.Done(ctx, breaker.Failure))
	}
	_, err = b.Acquire(ctx, "secret@example.com")
	require.ErrorIs(t, err, breaker.ErrOpen)

	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_circuit_open Breakers this instance currently holds open without asking Redis.
# TYPE tollgate_circuit_open gauge
tollgate_circuit_open 1
# HELP tollgate_circuit_trips_total Transitions from closed to open this instance's calls made.
# TYPE tollgate_circuit_trips_total counter
tollgate_circuit_trips_total 1
`), "tollgate_circuit_open", "tollgate_circuit_trips_total"))
	got, err := testutil.GatherAndCount(reg, "tollgate_circuit_calls_total")
	require.NoError(t, err)
	require.Equal(t, 6, got, "granted and rejected for every state, from the first scrape")
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		require.NotContains(t, f.String(), "secret", "no key in any label")
	}
	require.Panics(t, func() { tgprom.NewBreaker(nil) })
}
