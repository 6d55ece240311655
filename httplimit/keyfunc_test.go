package httplimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testProxies = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("2001:db8:ffff::/48"),
}

func TestByIP(t *testing.T) {
	// The cases live with internal/clientip; these check the wiring: the
	// peer is RemoteAddr, the header fields are the request's, in any case,
	// and a keyless request is ErrNoKey without the address in the error.
	fwd := IPOptions{TrustedProxies: testProxies, ProxyHeader: "forwarded", IPv4Bits: 24}
	tests := []struct {
		name   string
		opts   IPOptions
		remote string
		header map[string]string // set with Header.Add
		want   string            // "" means ErrNoKey
	}{
		{"peer", IPOptions{}, "203.0.113.7:1234", nil, "ip:203.0.113.7"},
		{"ipv6 by /64", IPOptions{}, "[2001:db8:1:2:3:4:5:6]:443", nil, "ip:2001:db8:1:2::/64"},
		{"unix socket", IPOptions{}, "@", nil, ""},
		{"xff", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", map[string]string{"x-forwarded-for": "198.51.100.1, 203.0.113.7"}, "ip:203.0.113.7"},
		{"xff garbage", IPOptions{TrustedProxies: testProxies}, "10.0.0.1:1", map[string]string{"X-Forwarded-For": "203.0.113.7, garbage"}, ""},
		{"forwarded, ipv4 by /24", fwd, "10.0.0.1:1", map[string]string{"FORWARDED": "for=203.0.113.7"}, "ip:203.0.113.0/24"},
		{"forwarded unknown", fwd, "10.0.0.1:1", map[string]string{"Forwarded": "for=203.0.113.7, for=unknown"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = tt.remote
			for name, value := range tt.header {
				r.Header.Add(name, value)
			}
			key, err := ByIPWith(tt.opts)(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				assert.NotContains(t, err.Error(), "203.0.113.7", "the error must not hold the address")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
}

func TestByIPIsByIPWith(t *testing.T) {
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "10.0.0.1:1"
	r.Header.Set("X-Forwarded-For", "203.0.113.7")

	key, err := ByIP()(r)
	require.NoError(t, err)
	assert.Equal(t, "ip:10.0.0.1", key)

	key, err = ByIP(testProxies...)(r)
	require.NoError(t, err)
	assert.Equal(t, "ip:203.0.113.7", key)
}

func TestByIPIsolatesClients(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := Middleware(newLimiter(t), ByIP(), WithPlans("slow"))(ok)
		serve := func(remote string) int {
			r := httptest.NewRequest("GET", "/", nil)
			r.RemoteAddr = remote
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			return w.Code
		}
		steps := []struct {
			remote string
			want   int
		}{
			{"203.0.113.7:1000", 200},
			{"203.0.113.7:1001", 200},
			{"203.0.113.7:1002", 429}, // same address, another port: same key
			{"203.0.113.8:1000", 200}, // another address: its own buckets
			{"[2001:db8:1:2::1]:1", 200},
			{"[2001:db8:1:2::2]:1", 200},
			{"[2001:db8:1:2::3]:1", 429}, // same /64
			{"[2001:db8:1:3::1]:1", 200},
			{"[::ffff:203.0.113.8]:1", 200}, // mapped: the same key as 203.0.113.8
			{"203.0.113.8:1", 429},
		}
		for i, s := range steps {
			assert.Equal(t, s.want, serve(s.remote), "step %d: %s", i, s.remote)
		}
	})
}

func TestByIPWithPanicsOnBadOptions(t *testing.T) {
	for want, o := range map[string]IPOptions{
		"httplimit: IPOptions.IPv4Bits 33 is not 1 to 32":                                       {IPv4Bits: 33},
		"httplimit: IPOptions.IPv6Bits -1 is not 1 to 128":                                      {IPv6Bits: -1},
		`httplimit: IPOptions.ProxyHeader "X-Real-IP" is neither X-Forwarded-For nor Forwarded`: {ProxyHeader: "X-Real-IP"},
		"httplimit: IPOptions.TrustedProxies holds an invalid prefix":                           {TrustedProxies: []netip.Prefix{{}}},
	} {
		assert.PanicsWithValue(t, want, func() { ByIPWith(o) })
	}
}

func TestByHeader(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   string // "" means ErrNoKey
	}{
		{"present", []string{"abc"}, "header:X-Api-Key:abc"},
		{"first of several", []string{"abc", "def"}, "header:X-Api-Key:abc"},
		{"a value that spells an ip key", []string{"ip:203.0.113.7"}, "header:X-Api-Key:ip:203.0.113.7"},
		{"missing", nil, ""},
		{"empty", []string{""}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/", nil)
			if tt.values != nil {
				r.Header["X-Api-Key"] = tt.values
			}
			key, err := ByHeader("x-api-key")(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
	assert.PanicsWithValue(t, "httplimit: ByHeader: empty header name", func() { ByHeader("") })
}

type principalKey struct{}

func principalOf(ctx context.Context) (string, bool) {
	id, ok := ctx.Value(principalKey{}).(string)
	return id, ok
}

func TestByPrincipal(t *testing.T) {
	tests := []struct {
		name string
		ctx  context.Context
		want string // "" means ErrNoKey
	}{
		{"authenticated", context.WithValue(context.Background(), principalKey{}, "user-42"), "principal:user-42"},
		{"anonymous", context.Background(), ""},
		{"empty id", context.WithValue(context.Background(), principalKey{}, ""), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequestWithContext(tt.ctx, "GET", "/", nil)
			key, err := ByPrincipal(principalOf)(r)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrNoKey)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}
}

func TestByPrincipalPanicsOnNil(t *testing.T) {
	// When called, at startup, not on the first request (ADR 6).
	assert.PanicsWithValue(t, "httplimit: ByPrincipal: nil principal func", func() { ByPrincipal(nil) })
}

func TestPerRoutePanicsOnNil(t *testing.T) {
	// When called, at startup, not on the first request (ADR 6).
	assert.PanicsWithValue(t, "httplimit: PerRoute: nil KeyFunc", func() { PerRoute(nil) })
}

func TestPerRoute(t *testing.T) {
	tests := []struct {
		name    string
		pattern string
		target  string
		want    string
	}{
		{"pattern", "GET /items/{id}", "/items/7", "GET /items/{id}|header:X-Api-Key:k"},
		{"path without pattern", "", "/items/7", "/items/7|header:X-Api-Key:k"},
		{"separator in path is escaped", "", "/a%7Cheader:X-Api-Key:k", "/a%7Cheader:X-Api-Key:k|header:X-Api-Key:k"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", tt.target, nil)
			r.Pattern = tt.pattern
			r.Header.Set("X-Api-Key", "k")
			key, err := PerRoute(ByHeader("X-Api-Key"))(r)
			require.NoError(t, err)
			assert.Equal(t, tt.want, key)
		})
	}

	_, err := PerRoute(ByHeader("X-Api-Key"))(httptest.NewRequest("GET", "/", nil))
	assert.ErrorIs(t, err, ErrNoKey)
}

// proxiedRequest returns a request from the trusted proxy 10.0.0.1 whose
// header name holds about size bytes that a client sent, then last, the
// entry the proxy appended.
func proxiedRequest(name string, size int, last string) *http.Request {
	spoof := "10.9.9.9, garbage, "
	if name == "Forwarded" {
		spoof = `for=10.9.9.9, for=garbage;proto="a, b", `
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "10.0.0.1:1234"
	r.Header.Set(name, strings.Repeat(spoof, size/len(spoof))+last)
	return r
}

func TestByIPAllocations(t *testing.T) {
	// A long proxy header costs nothing: the key is the one allocation,
	// and a keyless request, with garbage where the address should be,
	// has none.
	tests := []struct {
		name   string
		key    KeyFunc
		r      *http.Request
		allocs float64
	}{
		{"xff", ByIP(testProxies...), proxiedRequest("X-Forwarded-For", 64<<10, "203.0.113.7"), 1},
		{"xff garbage", ByIP(testProxies...), proxiedRequest("X-Forwarded-For", 64<<10, "garbage"), 0},
		{"forwarded", ByIPWith(IPOptions{TrustedProxies: testProxies, ProxyHeader: "Forwarded"}),
			proxiedRequest("Forwarded", 64<<10, "for=203.0.113.7"), 1},
		{"forwarded garbage", ByIPWith(IPOptions{TrustedProxies: testProxies, ProxyHeader: "Forwarded"}),
			proxiedRequest("Forwarded", 64<<10, "for=garbage"), 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			allocs := testing.AllocsPerRun(20, func() { _, _ = tt.key(tt.r) })
			assert.Equal(t, tt.allocs, allocs)
		})
	}
}

// BenchmarkByIP measures ByIP behind a trusted proxy, with the header a
// client sent growing ahead of the client address the proxy appended: the
// cost must not grow with it.
func BenchmarkByIP(b *testing.B) {
	for _, header := range []string{"X-Forwarded-For", "Forwarded"} {
		key, last, prefix := ByIP(testProxies...), "203.0.113.7", "xff"
		if header == "Forwarded" {
			key = ByIPWith(IPOptions{TrustedProxies: testProxies, ProxyHeader: header})
			last, prefix = "for=203.0.113.7", "forwarded"
		}
		for _, size := range []struct {
			name  string
			bytes int
		}{{"1-entry", 0}, {"8KiB", 8 << 10}, {"64KiB", 64 << 10}} {
			r := proxiedRequest(header, size.bytes, last)
			b.Run(prefix+"-"+size.name, func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if _, err := key(r); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
