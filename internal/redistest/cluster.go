package redistest

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	clusterSlots = 16384
	// clusterNodeTimeout is cluster-node-timeout in milliseconds: small, so
	// that failures are detected and failovers happen within seconds.
	clusterNodeTimeout = 1000
)

// Cluster is a Redis Cluster started by StartCluster.
type Cluster struct {
	t        testing.TB
	servers  []*Server // masters first, then the replicas of master 0, of master 1, ...
	masters  int
	replicas int // per master
}

// StartCluster starts masters*(1+replicasPerMaster) cluster-enabled servers,
// assigns the 16384 slots evenly to the masters, attaches replicas, and waits
// until every node reports cluster_state:ok and agrees on the slot map (and
// replicas are in sync if any). Nodes use cluster-node-timeout 1000 ms and
// cluster-replica-validity-factor 0 (a replica may always fail over), so
// failover tests are quick.
//
// The cluster is built with plain commands (CLUSTER SET-CONFIG-EPOCH,
// ADDSLOTS, MEET, REPLICATE) rather than `redis-cli --cluster create`,
// which sleeps. Redis keeps a fresh master out of cluster_state:ok for 2 s
// after it starts, so this takes a little over 2 s.
func StartCluster(t testing.TB, masters, replicasPerMaster int) *Cluster {
	t.Helper()
	SkipIfUnavailable(t)
	if masters < 1 || masters > clusterSlots || replicasPerMaster < 0 {
		t.Fatalf("redistest: StartCluster(%d, %d): need at least one master and no negative replica count", masters, replicasPerMaster)
	}
	began := time.Now()
	n := masters * (1 + replicasPerMaster)
	c := &Cluster{t: t, masters: masters, replicas: replicasPerMaster}
	for range n {
		c.servers = append(c.servers, newServer(t, true, plainArgs([]string{
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.Itoa(clusterNodeTimeout),
			"--cluster-replica-validity-factor", "0",
		})))
	}
	if err := startAll(c.servers); err != nil {
		t.Fatalf("redistest: start cluster: %v", err)
	}
	if err := c.build(); err != nil {
		c.killAll()
		t.Fatalf("redistest: start cluster of %d masters with %d replicas each: %v", masters, replicasPerMaster, err)
	}
	t.Logf("redistest: cluster of %d masters with %d replicas each ready in %v", masters, replicasPerMaster, time.Since(began).Round(time.Millisecond))
	return c
}

func (c *Cluster) killAll() {
	for _, s := range c.servers {
		s.Kill()
	}
}

// masterOf returns the index of the master that node i replicates, or -1 if
// node i is a master.
func (c *Cluster) masterOf(i int) int {
	if i < c.masters {
		return -1
	}
	return (i - c.masters) / c.replicas
}

// slotRange returns the slots given to master i.
func (c *Cluster) slotRange(i int) (lo, hi int) {
	return i * clusterSlots / c.masters, (i+1)*clusterSlots/c.masters - 1
}

// build joins the started servers into a cluster and waits until it is ready.
func (c *Cluster) build() error {
	n := len(c.servers)
	conns := make([]*conn, n)
	for i, s := range c.servers {
		conns[i] = &conn{addr: s.Addr()}
	}
	defer func() {
		for _, cn := range conns {
			cn.close()
		}
	}()
	ids := make([]string, n)
	for i, cn := range conns {
		id, err := cn.doString("CLUSTER", "MYID")
		if err != nil {
			return fmt.Errorf("%s: CLUSTER MYID: %w", cn.addr, err)
		}
		ids[i] = id
		// Distinct epochs avoid the slow epoch-collision resolution.
		if _, err := cn.do("CLUSTER", "SET-CONFIG-EPOCH", strconv.Itoa(i+1)); err != nil {
			return fmt.Errorf("%s: CLUSTER SET-CONFIG-EPOCH: %w", cn.addr, err)
		}
	}
	for i := range c.masters {
		// ADDSLOTS with every slot, not 7.0's ADDSLOTSRANGE, so that the
		// harness runs on older servers too.
		lo, hi := c.slotRange(i)
		args := []string{"CLUSTER", "ADDSLOTS"}
		for slot := lo; slot <= hi; slot++ {
			args = append(args, strconv.Itoa(slot))
		}
		if _, err := conns[i].do(args...); err != nil {
			return fmt.Errorf("%s: CLUSTER ADDSLOTS: %w", conns[i].addr, err)
		}
	}
	// A full mesh of MEETs (one per pair) joins the nodes without waiting
	// for gossip to spread.
	for i := range n {
		for j := i + 1; j < n; j++ {
			if _, err := conns[i].do("CLUSTER", "MEET", "127.0.0.1", strconv.Itoa(c.servers[j].Port())); err != nil {
				return fmt.Errorf("%s: CLUSTER MEET %s: %w", conns[i].addr, c.servers[j].Addr(), err)
			}
		}
	}

	// The expected view of every node, as in CLUSTER NODES.
	want := make(map[string]string, n) // id -> "master <slots>" or "slave <master id>"
	for i := range n {
		if m := c.masterOf(i); m >= 0 {
			want[ids[i]] = "slave " + ids[m]
		} else {
			lo, hi := c.slotRange(i)
			slots := strconv.Itoa(lo)
			if hi != lo {
				slots += "-" + strconv.Itoa(hi)
			}
			want[ids[i]] = "master " + slots
		}
	}

	replicated := make([]bool, n)
	var bad int // index of the node that failed the last check
	err := poll(func() error {
		// CLUSTER REPLICATE fails until the replica has finished the
		// handshake with its master; retry it on every round.
		for i := range n {
			if m := c.masterOf(i); m >= 0 && !replicated[i] {
				bad = i
				if _, err := conns[i].do("CLUSTER", "REPLICATE", ids[m]); err != nil {
					return fmt.Errorf("%s: CLUSTER REPLICATE %s: %w", conns[i].addr, c.servers[m].Addr(), err)
				}
				replicated[i] = true
			}
		}
		for i, cn := range conns {
			bad = i
			info, err := cn.doString("CLUSTER", "INFO")
			if err != nil {
				return fmt.Errorf("%s: CLUSTER INFO: %w", cn.addr, err)
			}
			if st := infoField(info, "cluster_state"); st != "ok" {
				return fmt.Errorf("%s: cluster_state:%s", cn.addr, st)
			}
			nodes, err := cn.doString("CLUSTER", "NODES")
			if err != nil {
				return fmt.Errorf("%s: CLUSTER NODES: %w", cn.addr, err)
			}
			if err := checkNodes(nodes, want); err != nil {
				return fmt.Errorf("%s: %w", cn.addr, err)
			}
			if c.masterOf(i) < 0 {
				continue
			}
			repl, err := cn.doString("INFO", "replication")
			if err != nil {
				return fmt.Errorf("%s: INFO replication: %w", cn.addr, err)
			}
			if st := infoField(repl, "master_link_status"); st != "up" || infoField(repl, "master_sync_in_progress") != "0" {
				return fmt.Errorf("%s: replica not in sync: master_link_status:%s", cn.addr, st)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w\n%s", err, c.servers[bad].logTail())
	}
	return nil
}

// checkNodes compares the output of CLUSTER NODES with want (see build).
func checkNodes(nodes string, want map[string]string) error {
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(nodes), "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			return fmt.Errorf("bad CLUSTER NODES line %q", line)
		}
		id, flags, master, link := f[0], ","+f[2]+",", f[3], f[7]
		w, ok := want[id]
		if !ok {
			return fmt.Errorf("unexpected node in CLUSTER NODES: %q", line)
		}
		for _, b := range []string{"handshake", "fail", "fail?", "noaddr"} {
			if strings.Contains(flags, ","+b+",") {
				return fmt.Errorf("node %s is %s", f[1], b)
			}
		}
		if link != "connected" {
			return fmt.Errorf("link to node %s is %s", f[1], link)
		}
		var got string
		switch {
		case strings.Contains(flags, ",master,"):
			got = "master " + strings.Join(f[8:], " ")
		case strings.Contains(flags, ",slave,"):
			got = "slave " + master
		}
		if got != w {
			return fmt.Errorf("node %s is %q, want %q", f[1], got, w)
		}
		seen++
	}
	if seen != len(want) {
		return fmt.Errorf("knows %d nodes, want %d", seen, len(want))
	}
	return nil
}

// Addrs returns the address of every node, masters first.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.servers))
	for i, s := range c.servers {
		addrs[i] = s.Addr()
	}
	return addrs
}

// Servers returns every node, masters first, then the replicas of the first
// master, of the second, and so on. Roles change after a failover; use
// MasterFor to find the node serving a key.
func (c *Cluster) Servers() []*Server {
	return append([]*Server(nil), c.servers...)
}

// Client returns a go-redis cluster client for the cluster, closed when t
// ends. opt may be nil; it is copied and its Addrs are set to Addrs().
//
// After a master is killed, go-redis keeps sending that slot range to the
// dead node until its slot map is reloaded, which by default happens only
// every 60 s (connection errors do not trigger a reload). Failover tests
// should set opt.ClusterStateReloadInterval (a few hundred ms) or call
// ReloadState on the client.
func (c *Cluster) Client(t testing.TB, opt *redis.ClusterOptions) *redis.ClusterClient {
	t.Helper()
	var o redis.ClusterOptions
	if opt != nil {
		o = *opt
	}
	o.Addrs = c.Addrs()
	cc := redis.NewClusterClient(&o)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// MasterFor returns the node currently serving key's slot, as reported by
// CLUSTER SLOTS on the majority of the running nodes. It calls t.Fatal (on
// the t given to StartCluster) if no running node answers.
func (c *Cluster) MasterFor(key string) *Server {
	c.t.Helper()
	slot := int64(-1)
	votes := map[int]int{} // port -> number of nodes saying it serves slot
	var errs []string
	for _, s := range c.servers {
		if !s.running() {
			continue
		}
		if slot < 0 {
			v, err := command(s.Addr(), "CLUSTER", "KEYSLOT", key)
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s: CLUSTER KEYSLOT: %v", s.Addr(), err))
				continue
			}
			slot, _ = v.(int64)
		}
		v, err := command(s.Addr(), "CLUSTER", "SLOTS")
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: CLUSTER SLOTS: %v", s.Addr(), err))
			continue
		}
		if port, ok := slotOwner(v, slot); ok {
			votes[port]++
		}
	}
	best, bestVotes := 0, 0
	for port, n := range votes {
		if n > bestVotes || (n == bestVotes && port < best) {
			best, bestVotes = port, n
		}
	}
	for _, s := range c.servers {
		if bestVotes > 0 && s.Port() == best {
			return s
		}
	}
	c.t.Fatalf("redistest: no running cluster node knows who serves key %q (slot %d): %s", key, slot, strings.Join(errs, "; "))
	return nil
}

// slotOwner finds the master port serving slot in a CLUSTER SLOTS reply.
func slotOwner(v any, slot int64) (int, bool) {
	ranges, _ := v.([]any)
	for _, r := range ranges {
		e, _ := r.([]any)
		if len(e) < 3 {
			continue
		}
		lo, _ := e[0].(int64)
		hi, _ := e[1].(int64)
		if slot < lo || slot > hi {
			continue
		}
		node, _ := e[2].([]any)
		if len(node) < 2 {
			continue
		}
		port, _ := node[1].(int64)
		return int(port), port > 0
	}
	return 0, false
}
