package redistest

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"
)

func TestServerKillRestart(t *testing.T) {
	SkipIfUnavailable(t)
	ctx := context.Background()
	began := time.Now()
	s := StartServer(t, "--maxmemory", "1mb")
	t.Logf("server ready in %v", time.Since(began).Round(time.Millisecond))
	port, addr := s.Port(), s.Addr()
	if want := fmt.Sprintf("127.0.0.1:%d", port); addr != want {
		t.Fatalf("Addr() = %q, want %q", addr, want)
	}
	c := s.Client(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	if got := c.ConfigGet(ctx, "maxmemory").Val()["maxmemory"]; got != "1048576" {
		t.Fatalf("maxmemory = %q, want 1048576 (extra args not applied)", got)
	}
	if got := c.ConfigGet(ctx, "save").Val()["save"]; got != "" {
		t.Fatalf("save = %q, want empty", got)
	}

	s.Kill()
	s.Kill() // idempotent
	if s.running() {
		t.Fatal("server still running after Kill")
	}
	if _, err := command(addr, "PING"); err == nil {
		t.Fatal("PING succeeded after Kill")
	}

	began = time.Now()
	s.Restart()
	t.Logf("server restarted in %v", time.Since(began).Round(time.Millisecond))
	if s.Port() != port || s.Addr() != addr {
		t.Fatalf("after Restart: %s, want %s", s.Addr(), addr)
	}
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Restart: %v", err)
	}
	if got := c.ConfigGet(ctx, "maxmemory").Val()["maxmemory"]; got != "1048576" {
		t.Fatalf("after Restart maxmemory = %q, want 1048576", got)
	}
}

func TestAddr(t *testing.T) {
	t.Setenv(envAddr, "")
	SkipIfUnavailable(t)
	addr := Addr(t)
	if v, err := command(addr, "PING"); err != nil || v != "PONG" {
		t.Fatalf("PING %s = %v, %v", addr, v, err)
	}
	t.Setenv(envAddr, "192.0.2.1:1")
	if got := Addr(t); got != "192.0.2.1:1" {
		t.Fatalf("Addr with %s set = %q", envAddr, got)
	}
}

func TestCleanupStopsEverything(t *testing.T) {
	SkipIfUnavailable(t)
	var servers []*Server
	t.Run("start", func(t *testing.T) {
		s := StartServer(t)
		s.Kill()
		s.Restart()
		servers = append(servers, s)
		sen := StartSentinel(t)
		servers = append(servers, sen.Master(), sen.sentinel)
	})
	for _, s := range servers {
		if s.running() {
			t.Errorf("%s still running after its test ended", s.Addr())
		}
	}
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	if bytes.Contains(buf, []byte("redistest.(*Server)")) {
		t.Errorf("goroutine of this package outlived the cleanup:\n%s", buf)
	}
}

func TestMajorVersion(t *testing.T) {
	v := MajorVersion(t)
	if v < 5 || v > 20 {
		t.Fatalf("redis-server major version %d: the harness expects 5 to 20", v)
	}
	t.Logf("redis-server %d", v)
}
