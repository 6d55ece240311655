package redistest

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"strings"
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

func TestCluster(t *testing.T) {
	SkipIfUnavailable(t)
	ctx := context.Background()
	began := time.Now()
	c := StartCluster(t, 3, 0)
	t.Logf("cluster 3 ready in %v", time.Since(began).Round(time.Millisecond))
	if n := len(c.Addrs()); n != 3 {
		t.Fatalf("len(Addrs()) = %d, want 3", n)
	}
	cc := c.Client(t, nil)

	// Write keys until every master holds at least one.
	hit := map[*Server]string{}
	for i := 0; len(hit) < 3 && i < 1000; i++ {
		key := fmt.Sprintf("redistest:%d", i)
		if err := cc.Set(ctx, key, key, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
		if got, err := cc.Get(ctx, key).Result(); err != nil || got != key {
			t.Fatalf("GET %s = %q, %v", key, got, err)
		}
		m := c.MasterFor(key)
		if _, ok := hit[m]; !ok {
			hit[m] = key
		}
	}
	if len(hit) != 3 {
		t.Fatalf("keys landed on %d masters, want 3", len(hit))
	}
	// Check that MasterFor is right: the key is stored on that node.
	for m, key := range hit {
		v, err := command(m.Addr(), "GET", key)
		if err != nil || v != key {
			t.Fatalf("GET %s directly on %s = %v, %v", key, m.Addr(), v, err)
		}
	}
}

func TestClusterReplicas(t *testing.T) {
	SkipIfUnavailable(t)
	ctx := context.Background()
	began := time.Now()
	c := StartCluster(t, 3, 1)
	t.Logf("cluster 3+3 ready in %v", time.Since(began).Round(time.Millisecond))
	if n := len(c.Servers()); n != 6 {
		t.Fatalf("len(Servers()) = %d, want 6", n)
	}
	replicas := 0
	for _, s := range c.Servers() {
		info, err := commandString(s.Addr(), "INFO", "replication")
		if err != nil {
			t.Fatal(err)
		}
		switch infoField(info, "role") {
		case "master":
			if got := infoField(info, "connected_slaves"); got != "1" {
				t.Errorf("master %s: connected_slaves:%s, want 1", s.Addr(), got)
			}
		case "slave":
			replicas++
		}
	}
	if replicas != 3 {
		t.Fatalf("%d replicas, want 3", replicas)
	}
	// CLUSTER INFO rather than 7.0's CLUSTER SHARDS, to run on older
	// servers too; the replicas were counted above.
	info, err := c.Client(t, nil).ClusterInfo(ctx).Result()
	if err != nil {
		t.Fatalf("CLUSTER INFO: %v", err)
	}
	if got := infoField(info, "cluster_slots_assigned"); got != "16384" {
		t.Errorf("cluster_slots_assigned:%s, want 16384", got)
	}
}

func TestSentinel(t *testing.T) {
	SkipIfUnavailable(t)
	ctx := context.Background()
	began := time.Now()
	s := StartSentinel(t)
	t.Logf("sentinel ready in %v", time.Since(began).Round(time.Millisecond))
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
