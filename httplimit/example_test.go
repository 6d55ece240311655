package httplimit_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"time"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/httplimit"
)

func ExampleMiddleware() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "burst", Capacity: 2, Rate: tollgate.Per(1, time.Minute)},
	})
	if err != nil {
		panic(err)
	}
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello")
	})
	h := httplimit.Middleware(lim, httplimit.ByHeader("X-API-Key"), httplimit.WithPlans("burst"))(api)

	for range 3 {
		r := httptest.NewRequest("GET", "/", nil)
		r.Header.Set("X-API-Key", "demo")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%d %s", w.Code, w.Body)
		for _, name := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After"} {
			if v := w.Header().Get(name); v != "" {
				fmt.Printf("  %s: %s\n", name, v)
			}
		}
	}
	// Output:
	// 200 hello
	//   RateLimit-Policy: "burst";q=2;w=120
	//   RateLimit: "burst";r=1;t=60
	//   X-RateLimit-Remaining: 1
	//   X-RateLimit-Reset: 60
	// 200 hello
	//   RateLimit-Policy: "burst";q=2;w=120
	//   RateLimit: "burst";r=0;t=60
	//   X-RateLimit-Remaining: 0
	//   X-RateLimit-Reset: 120
	// 429 too many requests
	//   RateLimit-Policy: "burst";q=2;w=120
	//   RateLimit: "burst";r=0;t=60
	//   X-RateLimit-Remaining: 0
	//   X-RateLimit-Reset: 120
	//   Retry-After: 60
}

func ExampleByIPWith() {
	key := httplimit.ByIPWith(httplimit.IPOptions{
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
	})
	for _, c := range []struct{ peer, xff string }{
		{"203.0.113.7:50123", ""},
		{"203.0.113.7:50123", "198.51.100.1"},              // untrusted peer: header ignored
		{"10.0.0.2:443", "198.51.100.1, 203.0.113.9"},      // rightmost untrusted address
		{"10.0.0.2:443", "2001:db8:1:2:3:4:5:6, 10.0.0.3"}, // IPv6 by /64
		{"10.0.0.2:443", "203.0.113.9, garbage"},           // rightmost entry not an address
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = c.peer
		if c.xff != "" {
			r.Header.Set("X-Forwarded-For", c.xff)
		}
		k, err := key(r)
		fmt.Printf("%q %v\n", k, err)
	}
	// Output:
	// "ip:203.0.113.7" <nil>
	// "ip:203.0.113.7" <nil>
	// "ip:203.0.113.9" <nil>
	// "ip:2001:db8:1:2::/64" <nil>
	// "" httplimit: no rate limit key in request: client address is not an IP address
}
