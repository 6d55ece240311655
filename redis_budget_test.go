package tollgate

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
)

// The client settings docs/redis.md recommends give a call budget of 200 ms: a wait for a
// connection, then one network wait. Retries and redirects multiply it,
// batching adds a wait for a call under way; a client without a read
// timeout has none.
func TestRedisStoreCallBudget(t *testing.T) {
	readme := &redis.Options{Addr: "127.0.0.1:1", DialTimeout: 100 * time.Millisecond, ReadTimeout: 100 * time.Millisecond,
		WriteTimeout: 100 * time.Millisecond, PoolTimeout: 100 * time.Millisecond, MaxRetries: -1, DialerRetries: 1}
	retries := *readme
	retries.MaxRetries, retries.MaxRetryBackoff = 2, 10*time.Millisecond
	endless := *readme
	endless.ReadTimeout = -1
	for _, tc := range []struct {
		name   string
		client redis.UniversalClient
		want   time.Duration
	}{
		{"README", redis.NewClient(readme), readmeBudget},
		{"retries", redis.NewClient(&retries), 3*readmeBudget + 2*10*time.Millisecond},
		{"no read timeout", redis.NewClient(&endless), 0},
		{"cluster", redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{readme.Addr}, ReadTimeout: 100 * time.Millisecond,
			PoolTimeout: 100 * time.Millisecond, DialTimeout: 100 * time.Millisecond, DialerRetries: 1, MaxRedirects: 1, MaxRetryBackoff: 10 * time.Millisecond}), 2*readmeBudget + 10*time.Millisecond},
		{"ring", redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": readme.Addr}}), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer tc.client.Close()
			assert.Equal(t, tc.want, NewRedisStore(tc.client, WithoutBatching()).callBudget())
		})
	}
	c := redis.NewClient(readme)
	defer c.Close()
	assert.Equal(t, readmeBudget+100*time.Millisecond, NewRedisStore(c).callBudget(),
		"a batched decision may first wait for a call under way")
}
