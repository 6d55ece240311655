package tgotel_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/tollgate-go/tollgate/breaker"
	tgotel "github.com/tollgate-go/tollgate/metrics/otel"
)

// TestRegisterBreaker trips a shared breaker and reads its instruments:
// the same figures as tgprom's NewBreaker, and no key in any attribute.
func TestRegisterBreaker(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	b, err := breaker.NewShared(c, breaker.SharedSettings{MinCalls: 2, OpenFor: time.Minute}, breaker.WithLogger(nil))
	require.NoError(t, err)
	r, mp := newReader(t)
	reg, err := tgotel.RegisterBreaker(b, mp, tgotel.WithAttributes(attribute.String("downstream", "webhooks")))
	require.NoError(t, err)
	ctx := context.Background()
	for range 2 {
		tk, err := b.Acquire(ctx, "secret@example.com")
		require.NoError(t, err)
		require.NoError(t, tk.Done(ctx, breaker.Failure))
	}
	_, err = b.Acquire(ctx, "secret@example.com")
	require.ErrorIs(t, err, breaker.ErrOpen)

	s := b.Stats()
	assert.Equal(t, int64(1), r.value("tollgate.circuit.trips"))
	assert.Equal(t, int64(1), r.value("tollgate.circuit.open"))
	assert.Equal(t, int64(2), r.value("tollgate.circuit.calls", attribute.String("state", "closed"), attribute.String("result", "granted")))
	assert.Equal(t, int64(1), r.value("tollgate.circuit.calls", attribute.String("state", "open"), attribute.String("result", "rejected")))
	assert.Equal(t, int64(2), r.value("tollgate.circuit.outcomes", attribute.String("state", "closed"), attribute.String("outcome", "failure")))
	assert.Equal(t, int64(s.RoundTrips), r.value("tollgate.circuit.round_trips"))
	assert.Equal(t, int64(0), r.value("tollgate.circuit.store.outage"))
	assert.Equal(t, 6, r.points("tollgate.circuit.calls"), "granted and rejected for every state, from the first collection")
	for _, m := range r.collect() {
		assert.NotContains(t, fmt.Sprint(m.Data), "secret", "no key in %s", m.Name)
		assert.Contains(t, fmt.Sprint(m.Data), "webhooks", "WithAttributes on %s", m.Name)
	}
	require.NoError(t, reg.Unregister())
	assert.Panics(t, func() { _, _ = tgotel.RegisterBreaker(nil, mp) })
}
