package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestMain hands the contenders' server processes, which the harness
// starts from this test binary, to main.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		main()
		os.Exit(0)
	}
	os.Exit(redistest.Main(m))
}

// shortRun is a run of every contender brief enough for a test, logging
// to t's output.
func shortRun(t *testing.T, redisURL string, limit int64, keys int) config {
	return config{redisURL: redisURL, duration: 300 * time.Millisecond, rounds: 1, clients: 4, keys: keys, limit: limit, logs: t.Output()}
}

// TestEveryContenderAnswers runs the harness as a user does, on a
// redis-server it starts, and checks that every contender answered with
// no failure and a line in the report.
func TestEveryContenderAnswers(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	var out bytes.Buffer
	if err := run(context.Background(), shortRun(t, "", unreachable, 100), &out); err != nil {
		t.Fatalf("run: %v\n%s", err, &out)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 1+len(contenders) {
		t.Fatalf("the report has %d lines, want a header and one per contender:\n%s", len(lines), &out)
	}
	for i, c := range contenders {
		if f := strings.Fields(lines[1+i]); f[0] != c.name {
			t.Errorf("report line %d is %q, want contender %s", 1+i, lines[1+i], c.name)
		}
	}
}

// TestLimitersLimit gives every limiter a limit of 2 requests per
// identity over 5 identities: each must admit every identity's first 2
// requests and refuse most of the rest, which it does only if it keys by
// the identity in X-Forwarded-For.
func TestLimitersLimit(t *testing.T) {
	const limit, keys = 2, 5
	reqs := requests(keys)
	for _, c := range contenders {
		t.Run(c.name, func(t *testing.T) {
			srv := redistest.StartServer(t) // buckets of their own
			r, err := measure(context.Background(), c, shortRun(t, "redis://"+srv.Addr()+"/0", limit, keys), reqs)
			if err != nil {
				t.Fatal(err)
			}
			if r.failed > 0 || r.storeFailures > 0 {
				t.Errorf("%d requests and %d store calls failed", r.failed, r.storeFailures)
			}
			if c.name == "none" {
				if r.ok == 0 || r.limited > 0 {
					t.Errorf("%d admitted, %d refused; want all admitted", r.ok, r.limited)
				}
				return
			}
			// Keyed by one address for all, about 2 would be admitted;
			// unkeyed or unlimited, thousands. The bound above leaves room
			// for refill and for ulule's run to span several one-second
			// windows on a stalled machine.
			if r.ok < keys*limit || r.ok > 5*keys*limit || r.limited == 0 {
				t.Errorf("%d admitted, %d refused; want %d to %d admitted and some refused",
					r.ok, r.limited, keys*limit, 5*keys*limit)
			}
		})
	}
}

// TestCheckRejectsABrokenRun checks that a run with more than 1 in 1000
// requests failed or meeting a store failure, a refusal under a limit that
// no run reaches, or no answer at all is an error, and a clean one is not.
func TestCheckRejectsABrokenRun(t *testing.T) {
	active := []contender{{name: "x"}}
	for _, tc := range []struct {
		name  string
		r     result
		limit int64
		bad   bool
	}{
		{"clean", result{tally: tally{ok: 10}}, unreachable, false},
		{"refused under a reachable limit", result{tally: tally{ok: 10, limited: 5}}, 2, false},
		{"refused under an unreachable limit", result{tally: tally{ok: 10, limited: 1}}, unreachable, true},
		{"a failed request in 10", result{tally: tally{ok: 9, failed: 1}}, unreachable, true},
		{"a failed store call in 10", result{tally: tally{ok: 10}, storeFailures: 1}, unreachable, true},
		{"a failed request in 1000", result{tally: tally{ok: 999, failed: 1}}, unreachable, false},
		{"a failed store call in 1000", result{tally: tally{ok: 1000}, storeFailures: 1}, unreachable, false},
		{"a failure of each in 1000", result{tally: tally{ok: 999, failed: 1}, storeFailures: 1}, unreachable, true},
		{"nothing admitted", result{tally: tally{limited: 10}}, 2, true},
	} {
		err := check(active, [][]result{{tc.r}}, tc.limit)
		if (err != nil) != tc.bad {
			t.Errorf("%s: check = %v, want an error: %v", tc.name, err, tc.bad)
		}
	}
}

// TestServerFailsToStartWithoutRedis checks that a limiter whose Redis
// does not answer stops the harness before it measures anything.
func TestServerFailsToStartWithoutRedis(t *testing.T) {
	srv := redistest.StartServer(t)
	url := "redis://" + srv.Addr() + "/0"
	srv.Kill()
	cfg := shortRun(t, url, unreachable, 1)
	for _, c := range contenders {
		if c.name == "none" {
			continue
		}
		if s, err := startServer(c.name, cfg); err == nil {
			t.Errorf("%s started without Redis", c.name)
			_, _ = s.stop()
		}
	}
}

// TestStoreFailuresAreCounted checks that when Redis goes away under a
// running limiter, the harness hears of it: tollgate's fallback answers
// 200, so only the server's count of failed store calls can tell.
func TestStoreFailuresAreCounted(t *testing.T) {
	for _, c := range contenders {
		if c.name == "none" {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			srv := redistest.StartServer(t)
			cfg := shortRun(t, "redis://"+srv.Addr()+"/0", unreachable, 10)
			s, err := startServer(c.name, cfg)
			if err != nil {
				t.Fatal(err)
			}
			srv.Kill()
			r := drive(context.Background(), s.addr, requests(cfg.keys), cfg.clients, cfg.duration)
			n, err := s.stop()
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				t.Errorf("no store failure counted; %d admitted, %d failed", r.ok, r.failed)
			}
		})
	}
}

// TestHead checks that a server's log is passed on whole up to n lines,
// and cut after n with a count of the rest.
func TestHead(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"", ""},
		{"a\nb\n", "a\nb\n"},
		{"a\nb", "a\nb"},
		{"a\nb\nc\n", "a\nb\n(and 1 more lines)\n"},
		{"a\nb\nc\nd", "a\nb\n(and 2 more lines)\n"},
	} {
		if got := head(tc.text, 2); got != tc.want {
			t.Errorf("head(%q, 2) = %q, want %q", tc.text, got, tc.want)
		}
	}
}
