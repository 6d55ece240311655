package tollgate

import (
	"context"
	"encoding/base64"
	"fmt"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// decodeRedisKey reads (key, plan) back from a Redis key made by Key with
// prefix, as ADR 0003 says can be done: the first '}' after the first '{'
// ends the key's part; '=' marks base64url.
func decodeRedisKey(prefix, rk string) (key, plan string, ok bool) {
	rest, ok := strings.CutPrefix(rk, prefix+":{")
	if !ok {
		return "", "", false
	}
	k, plan, ok := strings.Cut(rest, "}:"+keySchema+":")
	if !ok {
		return "", "", false
	}
	if enc, ok := strings.CutPrefix(k, "="); ok {
		raw, err := base64.RawURLEncoding.DecodeString(enc)
		if err != nil {
			return "", "", false
		}
		return string(raw), plan, true
	}
	return k, plan, true
}

// FuzzKey checks the key scheme on fuzzed keys, plans and prefixes: Key
// never panics, whatever it is given; for valid input, the Redis key reads
// back as the (key, plan) it came from, so the mapping is injective; two
// different pairs never share a Redis key; and every plan of a key shares
// one Cluster hash tag, which is never empty.
func FuzzKey(f *testing.F) {
	for _, k := range adversarialKeys[:len(adversarialKeys)-2] {
		f.Add(defaultKeyPrefix, k, "gold", k+"}", "daily")
	}
	f.Add("app:v2", "user:42", "a.b-c_d", "user:42}", "a.b-c_d")
	f.Add("x", "=", "p", "", "p")
	f.Fuzz(func(t *testing.T, prefix, key1, plan1, key2, plan2 string) {
		if strings.ContainsAny(prefix, "{}") {
			prefix = defaultKeyPrefix // NewRedisStore rejects the others
		}
		s := NewRedisStore(nil, WithKeyPrefix(prefix))
		rk1, rk2 := s.Key(key1, plan1), s.Key(key2, plan2) // never a panic, even for invalid input
		valid := func(key, plan string) bool {
			return checkKey(key) == nil && Plan{Name: plan, Capacity: 1, Rate: 1}.validate() == nil
		}
		for _, c := range []struct{ key, plan, rk string }{{key1, plan1, rk1}, {key2, plan2, rk2}} {
			if !valid(c.key, c.plan) {
				continue
			}
			k, p, ok := decodeRedisKey(prefix, c.rk)
			if !ok || k != c.key || p != c.plan {
				t.Fatalf("Key(%q, %q) = %q reads back as (%q, %q, %v)", c.key, c.plan, c.rk, k, p, ok)
			}
			tag := hashTag(c.rk)
			if tag == "" || tag == c.rk {
				t.Fatalf("Key(%q, %q) = %q: no hash tag", c.key, c.plan, c.rk)
			}
			for _, other := range []string{"gold", plan1, plan2} {
				if valid(c.key, other) && hashTag(s.Key(c.key, other)) != tag {
					t.Fatalf("key %q: plans %q and %q have different hash tags", c.key, c.plan, other)
				}
			}
		}
		if valid(key1, plan1) && valid(key2, plan2) && (key1 != key2 || plan1 != plan2) && rk1 == rk2 {
			t.Fatalf("(%q, %q) and (%q, %q) share the Redis key %q", key1, plan1, key2, plan2, rk1)
		}
	})
}

// hashTag returns the part of a Redis key that Cluster hashes, by the rule
// of the Cluster specification.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func TestKeyScheme(t *testing.T) {
	s := NewRedisStore(redis.NewClient(&redis.Options{}))
	assert.Equal(t, "tollgate:{user:42}:2:gold", s.Key("user:42", "gold"), "plain keys are verbatim")
	keys := []string{
		"a", "}", "{", "{}", "}{", "a}b", "{a}", "=", "=a", "==", "a=", "=YQ", "x}:gold", "\x00", "\xff\xfe",
		"tollgate:{a}:gold", strings.Repeat("}", 1024), strings.Repeat("é", 512),
	}
	seen := map[string]string{}
	for _, k := range keys {
		var tag string
		for _, plan := range []string{"gold", "daily", "a.b-c_d"} {
			rk := s.Key(k, plan)
			if prev, dup := seen[rk]; dup {
				t.Errorf("key %q plan %s collides with %s", k, plan, prev)
			}
			seen[rk] = k + "/" + plan
			if tag == "" {
				tag = hashTag(rk)
			}
			assert.Equal(t, tag, hashTag(rk), "key %q: plans must share a hash tag", k)
			assert.NotEqual(t, rk, tag, "key %q: the tag must not be empty", k)
		}
	}
}

var adversarialKeys = []string{
	"plain", "}", "{", "{}", "}{", "a}b", "{a}", "{user}:gold", "x}:gold", "=", "=YQ",
	"tollgate:{a}:gold", "\x00\xff", "ключ", strings.Repeat("}", MaxKeyLen), strings.Repeat("{", MaxKeyLen),
}

func TestClusterAdversarialKeys(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	cl := redistest.StartCluster(t, 3, 0)
	client := cl.Client(t, nil)
	l, err := New(NewRedisStore(client), withWindow, WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
	require.NoError(t, err)
	ctx := context.Background()
	for i, key := range adversarialKeys {
		for want := int64(3); want >= 0; want-- {
			r, err := l.Allow(ctx, key, "gold", "daily", "minute")
			require.NoError(t, err, "key %d", i)
			require.True(t, r.Allowed, "key %d", i)
			assert.Equal(t, want, r.PlanResults()[0].Remaining, "key %d: keys must not share buckets", i)
			assert.Equal(t, want+2, r.PlanResults()[2].Remaining, "key %d: keys must not share windows", i)
		}
		require.NoError(t, l.Reset(ctx, key, "gold", "daily", "minute"), "key %d", i)
	}

	// Keys spread over every master, and NOSCRIPT heals on each.
	for _, addr := range cl.Addrs() {
		require.NoError(t, redis.NewClient(&redis.Options{Addr: addr}).ScriptFlush(ctx).Err())
	}
	masters := map[string]bool{}
	for i := 0; i < 30; i++ {
		key := fmt.Sprint("spread-", i)
		_, err := l.Allow(ctx, key, "gold", "daily", "minute")
		require.NoError(t, err)
		masters[cl.MasterFor(key).Addr()] = true
	}
	assert.Len(t, masters, 3)
}
