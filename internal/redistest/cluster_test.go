package redistest

import (
	"context"
	"fmt"
	"testing"
)

func TestCluster(t *testing.T) {
	ctx := context.Background()
	c := StartCluster(t, 3, 0) // skips without redis-server, and logs how long it took
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
	ctx := context.Background()
	c := StartCluster(t, 3, 1) // skips without redis-server, and logs how long it took
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
