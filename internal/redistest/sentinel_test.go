package redistest

import (
	"context"
	"strings"
	"testing"
)

func TestSentinel(t *testing.T) {
	ctx := context.Background()
	s := StartSentinel(t) // skips without redis-server, and logs how long it took
	if len(s.SentinelAddrs()) != 1 || s.MasterName() == "" {
		t.Fatalf("SentinelAddrs() = %v, MasterName() = %q", s.SentinelAddrs(), s.MasterName())
	}
	c := s.Client(t, nil)
	if err := c.Set(ctx, "redistest:k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "redistest:k").Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v", got, err)
	}
	m := s.Master()
	if v, err := command(m.Addr(), "GET", "redistest:k"); err != nil || v != "v" {
		t.Fatalf("GET on Master() %s = %v, %v", m.Addr(), v, err)
	}
	v, err := command(s.SentinelAddrs()[0], "SENTINEL", "REPLICAS", s.MasterName())
	if err != nil {
		t.Fatalf("SENTINEL REPLICAS: %v", err)
	}
	arr, _ := v.([]any)
	if len(arr) != 1 || !strings.Contains(pairs(arr[0])["flags"], "slave") {
		t.Fatalf("SENTINEL REPLICAS = %v, want one replica", v)
	}
}
