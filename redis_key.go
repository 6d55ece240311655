package tollgate

import (
	"encoding/base64"
	"strings"
)

// Key returns the Redis key of the bucket of plan for key:
//
//	prefix:{key}:plan
//
// The braces are a Redis Cluster hash tag, so every plan of a key lives in
// one hash slot and a chained decision is one script call. A key is written
// verbatim, so operators can find it with redis-cli, unless it contains '}'
// (which would end the hash tag early) or starts with '='; such a key is
// written as '=' and its unpadded base64url encoding. Either way the text
// inside the braces holds no '}', so (key, plan) can be read back from the
// Redis key: the mapping is injective.
func (s *RedisStore) Key(key, plan string) string {
	var b strings.Builder
	if strings.IndexByte(key, '}') >= 0 || strings.HasPrefix(key, "=") {
		b.Grow(len(s.prefix) + 5 + base64.RawURLEncoding.EncodedLen(len(key)) + len(plan))
		b.WriteString(s.prefix)
		b.WriteString(":{=")
		b.WriteString(base64.RawURLEncoding.EncodeToString([]byte(key)))
	} else {
		b.Grow(len(s.prefix) + 4 + len(key) + len(plan))
		b.WriteString(s.prefix)
		b.WriteString(":{")
		b.WriteString(key)
	}
	b.WriteString("}:")
	b.WriteString(plan)
	return b.String()
}
