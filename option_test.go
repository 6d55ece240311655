package tollgate

import (
	"context"
	"log/slog"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
)

// An option given to a constructor it is not for is a wiring mistake that
// New reports, naming the option and its constructor, and a store used on
// its own reports on every call.
func TestOptionOfAnotherConstructorIsAWiringMistake(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	defer func() { _ = c.Close() }()
	for _, tc := range []struct {
		name  string
		store func() Store
		opts  []Option
		want  string
	}{
		{"a store's option to New", func() Store { return NewMemoryStore() }, []Option{WithoutBatching()}, "WithoutBatching is an option of NewRedisStore, not of New"},
		{"New's option to NewRedisStore", func() Store { return NewRedisStore(c, WithShadow()) }, nil, "WithShadow is an option of New, not of NewRedisStore"},
		{"NewRedisStore's option to NewMemoryStore", func() Store { return NewMemoryStore(WithKeyPrefix("p")) }, nil, "WithKeyPrefix is an option of NewRedisStore, not of NewMemoryStore"},
		{"the zero Option", func() Store { return NewMemoryStore() }, []Option{{}}, "the zero Option"},
		{"a fallback store under FailOpen", func() Store { return NewRedisStore(c) }, []Option{WithFailurePolicy(breaker.FailOpen), WithFallback(NewMemoryStore())}, "WithFallback needs the Fallback failure policy"},
		{"a fleet under FailClosed", func() Store { return NewRedisStore(c) }, []Option{WithFailurePolicy(breaker.FailClosed), WithFleet(0)}, "WithFleet needs the Fallback failure policy"},
		{"a Logger without a Handler", func() Store { return NewMemoryStore() }, []Option{WithLogger(&slog.Logger{})}, "WithLogger: a Logger without a Handler"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.store(), testPlans, tc.opts...)
			require.ErrorIs(t, err, ErrInvalidOption)
			assert.ErrorContains(t, err, tc.want)
		})
	}
	_, err := NewMemoryStore(WithKeyPrefix("p")).Take(context.Background(), "k", 1, testPlans)
	assert.ErrorIs(t, err, ErrInvalidOption, "a MemoryStore used on its own")
	_, err = NewRedisStore(c, WithMaxKeys(5)).Take(context.Background(), "k", 1, testPlans)
	assert.ErrorIs(t, err, ErrInvalidOption, "a RedisStore used on its own")
}
