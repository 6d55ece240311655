package breaker_test

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
)

// TestSharedKeyFollowsTheKeyScheme: a breaker's key is the one ADR 3 gives
// the plan "cb", so operators find it the same way and Cluster puts it in
// the key's slot; without the schema of buckets and windows that ADR 28
// put in their keys, since the breaker's hash did not change.
func TestSharedKeyFollowsTheKeyScheme(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	b, err := breaker.NewShared(c, breaker.SharedSettings{}, breaker.WithPrefix("p"))
	require.NoError(t, err)
	store := tollgate.NewRedisStore(c, tollgate.WithKeyPrefix("p"))
	for _, key := range []string{"hook.example.com", "user:42", "a}b", "=x", "{x}", "é ü", "a{b"} {
		assert.Equal(t, strings.Replace(store.Key(key, "cb"), "}:2:cb", "}:cb", 1), b.Key(key), "key %q", key)
	}
	assert.Equal(t, "p:{user:42}:cb", b.Key("user:42"))
}
