package tollgate

import (
	"context"
	"encoding/base64"
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"
)

// keySchema is the version of the layout of keys and values that Key's
// keys hold, written into every key so that instances of another layout,
// such as the hash buckets of schema 1, never read or replace each
// other's data.
const keySchema = "2"

// Key returns the Redis key of plan's bucket or window for key:
//
//	prefix:{key}:2:plan
//
// 2 is the schema of the keys and their values. The braces are a
// Redis Cluster hash tag, so every plan of a key lives in one hash slot
// and a chained decision is one script call. A key is written
// verbatim, so operators can find it with redis-cli, unless it contains '}'
// (which would end the hash tag early) or starts with '='; such a key is
// written as '=' and its unpadded base64url encoding. Either way the text
// inside the braces holds no '}', so (key, plan) can be read back from the
// Redis key: the mapping is injective.
func (s *RedisStore) Key(key, plan string) string {
	var b strings.Builder
	if strings.IndexByte(key, '}') >= 0 || strings.HasPrefix(key, "=") {
		b.Grow(len(s.prefix) + 7 + base64.RawURLEncoding.EncodedLen(len(key)) + len(plan))
		b.WriteString(s.prefix)
		b.WriteString(":{=")
		b.WriteString(base64.RawURLEncoding.EncodeToString([]byte(key)))
	} else {
		b.Grow(len(s.prefix) + 6 + len(key) + len(plan))
		b.WriteString(s.prefix)
		b.WriteString(":{")
		b.WriteString(key)
	}
	b.WriteString("}:" + keySchema + ":")
	b.WriteString(plan)
	return b.String()
}

// spread implements mastersStore: a store on a Redis Cluster is spread
// over its masters.
func (s *RedisStore) spread() bool {
	_, ok := s.client.(*redis.ClusterClient)
	return ok
}

// masterOf implements mastersStore: the address of the master that holds
// the slot of key's bucket of plan, as the client's slot map says.
func (s *RedisStore) masterOf(ctx context.Context, key, plan string) (string, error) {
	c, ok := s.client.(*redis.ClusterClient)
	if !ok {
		return "", errNotSpread
	}
	master, err := c.MasterForKey(ctx, s.Key(key, plan))
	if err != nil {
		return "", err
	}
	return master.Options().Addr, nil
}

// errNotSpread is masterOf's error on a store not on a Cluster.
var errNotSpread = errors.New("not on a Redis Cluster")
