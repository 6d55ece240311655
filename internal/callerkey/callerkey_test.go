package callerkey

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestOf(t *testing.T) {
	for key, want := range map[string]string{
		"header:X-Api-Key:key-gold":                 "key-gold",
		"md:x-api-key:key-gold":                     "key-gold",
		"principal:user-42":                         "user-42",
		"ip:203.0.113.7":                            "203.0.113.7",
		"ip:2001:db8:1:2::/64":                      "2001:db8:1:2::/64",
		"GET /items/{id}|header:X-Api-Key:key-gold": "key-gold",
		"/shop.Cart/Add|md:x-api-key:key-gold":      "key-gold",
		"/a|GET /b|principal:user-42":               "user-42",
		"header:X-Api-Key:a|b|ip:203.0.113.7":       "a|b|ip:203.0.113.7",
		"GET /|header:X-Api-Key:with:colons":        "with:colons",
		"upstream:billing":                          "upstream:billing",
		"user-42":                                   "user-42",
		"route|user-42":                             "route|user-42",
		"header:X-Api-Key:":                         "header:X-Api-Key:",
		"ip:":                                       "ip:",
	} {
		assert.Equal(t, want, Of(key), key)
	}
}
