package redistest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	sentinelMasterName = "mymaster"
	// sentinelDownAfter is down-after-milliseconds.
	sentinelDownAfter = 1000
	// sentinelFailoverTimeout is failover-timeout in milliseconds.
	sentinelFailoverTimeout = 2000
)

// Sentinel is a master, one replica and one sentinel started by
// StartSentinel.
type Sentinel struct {
	t        testing.TB
	name     string
	servers  []*Server // the first master and its replica
	sentinel *Server
}

// StartSentinel starts a master, one replica and one sentinel (redis-server
// --sentinel with a generated config, quorum 1, down-after-milliseconds 1000,
// failover-timeout 2000) and waits until the sentinel knows the master and
// the replica.
func StartSentinel(t testing.TB) *Sentinel {
	t.Helper()
	SkipIfUnavailable(t)
	began := time.Now()
	master := newServer(t, false, plainArgs(nil))
	if err := startAll([]*Server{master}); err != nil {
		t.Fatalf("redistest: start sentinel master: %v", err)
	}
	replica := newServer(t, false, plainArgs([]string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port())}))
	if err := startAll([]*Server{replica}); err != nil {
		t.Fatalf("redistest: start sentinel replica: %v", err)
	}
	// Wait for the replica first: the sentinel learns about replicas from
	// the master's INFO, which it reads at once on connecting but then only
	// every 10 s.
	if err := waitReplicaInSync(replica); err != nil {
		t.Fatalf("redistest: start sentinel replica: %v\n%s\n%s", err, replica.logTail(), master.logTail())
	}
	s := &Sentinel{t: t, name: sentinelMasterName, servers: []*Server{master, replica}}
	s.sentinel = newServer(t, false, func(dir string) func(int) ([]string, error) {
		conf := filepath.Join(dir, "sentinel.conf")
		return func(port int) ([]string, error) {
			text := fmt.Sprintf(`port %[1]d
bind 127.0.0.1
daemonize no
dir %[2]q
sentinel monitor %[3]s 127.0.0.1 %[4]d 1
sentinel down-after-milliseconds %[3]s %[5]d
sentinel failover-timeout %[3]s %[6]d
sentinel parallel-syncs %[3]s 1
`, port, dir, s.name, master.Port(), sentinelDownAfter, sentinelFailoverTimeout)
			// The sentinel rewrites this file, so it must be writable.
			if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
				return nil, err
			}
			return []string{conf, "--sentinel"}, nil
		}
	})
	if err := startAll([]*Server{s.sentinel}); err != nil {
		t.Fatalf("redistest: start sentinel: %v", err)
	}
	err := poll(func() error {
		m, err := command(s.sentinel.Addr(), "SENTINEL", "MASTER", s.name)
		if err != nil {
			return err
		}
		if f := pairs(m)["flags"]; f != "master" {
			return fmt.Errorf("sentinel sees master flags %q", f)
		}
		v, err := command(s.sentinel.Addr(), "SENTINEL", "REPLICAS", s.name)
		if err != nil {
			return err
		}
		arr, _ := v.([]any)
		for _, r := range arr {
			p := pairs(r)
			if p["port"] == strconv.Itoa(replica.Port()) && p["flags"] == "slave" && p["master-link-status"] == "ok" {
				return nil
			}
		}
		return fmt.Errorf("sentinel does not know replica %s yet (replicas: %v)", replica.Addr(), arr)
	})
	if err != nil {
		t.Fatalf("redistest: start sentinel: %v\n%s", err, s.sentinel.logTail())
	}
	t.Logf("redistest: sentinel with master and replica ready in %v", time.Since(began).Round(time.Millisecond))
	return s
}

// waitReplicaInSync waits until replica reports its link to its master up
// and the initial sync done.
func waitReplicaInSync(replica *Server) error {
	c := &conn{addr: replica.Addr()}
	defer c.close()
	return poll(func() error {
		info, err := c.doString("INFO", "replication")
		if err != nil {
			return err
		}
		if st := infoField(info, "master_link_status"); st != "up" || infoField(info, "master_sync_in_progress") != "0" {
			return fmt.Errorf("%s: master_link_status:%s", replica.Addr(), st)
		}
		return nil
	})
}

// MasterName returns the name the sentinel monitors the master under.
func (s *Sentinel) MasterName() string { return s.name }

// SentinelAddrs returns the addresses of the sentinels (there is one).
func (s *Sentinel) SentinelAddrs() []string { return []string{s.sentinel.Addr()} }

// Master returns the current master per the sentinel (SENTINEL
// GET-MASTER-ADDR-BY-NAME): the first master, or the replica after a
// failover. It calls t.Fatal (on the t given to StartSentinel) if the sentinel
// does not answer or names another server.
func (s *Sentinel) Master() *Server {
	s.t.Helper()
	v, err := command(s.sentinel.Addr(), "SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.name)
	if err != nil {
		s.t.Fatalf("redistest: SENTINEL GET-MASTER-ADDR-BY-NAME: %v", err)
	}
	arr, _ := v.([]any)
	if len(arr) == 2 {
		port, _ := arr[1].(string)
		for _, srv := range s.servers {
			if strconv.Itoa(srv.Port()) == port {
				return srv
			}
		}
	}
	var ports []string
	for _, srv := range s.servers {
		ports = append(ports, strconv.Itoa(srv.Port()))
	}
	s.t.Fatalf("redistest: sentinel names master %v, not one of ports %s", v, strings.Join(ports, ", "))
	return nil
}

// Client returns redis.NewFailoverClient for the setup, closed when t ends.
// opt may be nil; it is copied and its MasterName and SentinelAddrs are set.
func (s *Sentinel) Client(t testing.TB, opt *redis.FailoverOptions) *redis.Client {
	t.Helper()
	var o redis.FailoverOptions
	if opt != nil {
		o = *opt
	}
	o.MasterName = s.name
	o.SentinelAddrs = s.SentinelAddrs()
	c := redis.NewFailoverClient(&o)
	t.Cleanup(func() { _ = c.Close() })
	return c
}
