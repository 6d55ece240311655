// Package redistest runs real redis-server processes for tests: single
// servers, clusters and sentinel setups. Every process listens on a free
// 127.0.0.1 port, keeps its files in a t.TempDir(), is killed with SIGKILL at
// the end of the test that started it (t.Cleanup), and is also killed by the
// kernel if the test binary dies first (Pdeathsig).
//
// It also holds what every test of a real Redis needs, whoever started the
// server: the client settings docs/redis.md recommends (FailFast), Redis's clock (Time) and key
// prefixes that keep tests apart on a shared server (KeyPrefix).
//
// Tests that need a real Redis skip when redis-server is not on PATH, and
// under -short, which keeps go test -short to MemoryStore and miniredis. A
// package that uses this one runs its tests through Main, which then names
// in one line how many skipped for want of redis-server.
//
// Methods that can fail report through the testing.TB given to the function
// that created the value, so they must be called from that test's goroutine
// (or from one of its cleanups).
package redistest

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	serverBinary = "redis-server"

	// envAddr names the environment variable read by Addr.
	envAddr = "TOLLGATE_REDIS_ADDR"

	waitTimeout  = 10 * time.Second
	pollInterval = 20 * time.Millisecond

	// busOffset is the distance between a cluster node's port and its
	// cluster bus port when cluster-port is not set.
	busOffset = 10000
	// maxClusterPort keeps port+busOffset below 65536 with a margin.
	maxClusterPort = 55000

	startAttempts = 3
)

// Available reports whether tests may start redis-server: it is on PATH
// and the tests do not run with -short, which leaves real Redis out.
func Available() bool {
	return !testing.Short() && onPath()
}

// onPath reports whether redis-server is on PATH.
func onPath() bool {
	_, err := exec.LookPath(serverBinary)
	return err == nil
}

// SkipIfUnavailable calls t.Skip with a clear message under -short and
// when redis-server is not on PATH. Main counts the latter.
func SkipIfUnavailable(t testing.TB) {
	t.Helper()
	SkipIfShort(t)
	if !onPath() {
		skippedNoServer.Add(1)
		t.Skip("redistest: redis-server not found on PATH; install Redis (for example `apt-get install redis-server`) to run this test")
	}
}

// MajorVersion returns the major version of the redis-server on PATH, from
// `redis-server --version` ("Redis server v=7.0.15 ..."), so that a test
// can use what that version offers: 7.0 added --enable-debug-command, and
// DEBUG is open without it before 7.0. It skips t when there is no
// redis-server, and fails it when the output does not parse.
func MajorVersion(t testing.TB) int {
	t.Helper()
	SkipIfUnavailable(t)
	out, err := exec.Command(serverBinary, "--version").Output()
	if err != nil {
		t.Fatalf("redistest: %s --version: %v", serverBinary, err)
	}
	_, v, ok := strings.Cut(string(out), " v=")
	major, _, _ := strings.Cut(v, ".")
	n, err := strconv.Atoi(major)
	if !ok || err != nil {
		t.Fatalf("redistest: cannot read the version in %q", out)
	}
	return n
}

// Addr returns the address of a real Redis for tests that only need one plain
// server: TOLLGATE_REDIS_ADDR if set (the caller must then use random key
// prefixes; this package never flushes it), otherwise a fresh server started
// with StartServer (stopped at test end), otherwise t.Skip. It skips under
// -short too.
func Addr(t testing.TB) string {
	t.Helper()
	SkipIfShort(t)
	if addr := os.Getenv(envAddr); addr != "" {
		return addr
	}
	SkipIfUnavailable(t)
	return StartServer(t).Addr()
}

// Server is one redis-server (or sentinel) process started by this package.
// Its methods are safe for concurrent use.
type Server struct {
	t       testing.TB
	dir     string
	logPath string
	// build returns the arguments for a first start on port. Restart reuses
	// the arguments of the last start instead.
	build func(port int) ([]string, error)
	// bus reports whether the server needs port+busOffset as well.
	bus bool

	mu   sync.Mutex
	port int
	args []string
	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has exited and been reaped
}

// StartServer starts redis-server on a free 127.0.0.1 port with --save ""
// --appendonly no, its dir in t.TempDir(), extra args appended (e.g.
// "--maxmemory", "1mb"), waits until it answers PING, and registers t.Cleanup
// to stop it. Diskless replication starts without delay
// (--repl-diskless-sync-delay 0) so that replicas attached in tests sync
// quickly; args can override that.
func StartServer(t testing.TB, args ...string) *Server {
	t.Helper()
	SkipIfUnavailable(t)
	s := newServer(t, false, plainArgs(args))
	if err := startAll([]*Server{s}); err != nil {
		t.Fatalf("redistest: %v", err)
	}
	return s
}

// plainArgs returns a build function for a standalone server.
func plainArgs(extra []string) func(dir string) func(port int) ([]string, error) {
	return func(dir string) func(int) ([]string, error) {
		return func(port int) ([]string, error) {
			a := []string{
				"--port", strconv.Itoa(port),
				"--bind", "127.0.0.1",
				"--dir", dir,
				"--daemonize", "no",
				"--save", "",
				"--appendonly", "no",
				"--repl-diskless-sync-delay", "0",
			}
			return append(a, extra...), nil
		}
	}
}

// newServer creates a Server with its own temporary directory and registers
// its cleanup. It does not start it.
func newServer(t testing.TB, bus bool, build func(dir string) func(port int) ([]string, error)) *Server {
	t.Helper()
	dir := t.TempDir()
	s := &Server{
		t:       t,
		dir:     dir,
		logPath: filepath.Join(dir, "redis.log"),
		build:   build(dir),
		bus:     bus,
	}
	// Registered after t.TempDir, so it runs before the directory is removed.
	t.Cleanup(s.Kill)
	return s
}

// Addr returns the server's address, "127.0.0.1:port".
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port()))
}

// Port returns the server's TCP port. It does not change across Restart.
func (s *Server) Port() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.port
}

// Kill sends SIGKILL to the server's process group and waits for the process
// to exit. It is idempotent, and a no-op when the server is not running.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

func (s *Server) killLocked() {
	if s.cmd == nil {
		return
	}
	// Setpgid made the server a group leader: kill the group, so that a
	// child it forked (RDB for a replica) dies too.
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-s.done:
	case <-time.After(waitTimeout):
		s.t.Errorf("redistest: %s (pid %d) did not exit %v after SIGKILL", serverBinary, s.cmd.Process.Pid, waitTimeout)
		return
	}
	s.cmd, s.done = nil, nil
}

// Restart starts the server again on the same port with the same arguments
// (and the same directory, so a cluster node keeps its nodes.conf) and waits
// until it answers PING. It kills the server first if it is still running.
// It calls t.Fatal on failure.
func (s *Server) Restart() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
	deadline := time.Now().Add(waitTimeout)
	for {
		off := s.logSize()
		err := s.launchLocked()
		if err == nil {
			err = s.waitReadyLocked(deadline)
		}
		if err == nil {
			return
		}
		s.killLocked()
		if !s.addrInUseSince(off) || time.Now().After(deadline) {
			s.t.Fatalf("redistest: restart %s: %v", s.addrLocked(), err)
		}
		time.Sleep(pollInterval)
	}
}

// Client returns a go-redis client for the server, closed when t ends.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	return NewClient(t, &redis.Options{Addr: s.Addr()})
}

func (s *Server) addrLocked() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// running reports whether the process is started and has not exited.
func (s *Server) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return false
	}
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// launchLocked starts the process with s.args on s.port without waiting.
func (s *Server) launchLocked() error {
	if s.cmd != nil {
		return errors.New("already running")
	}
	logf, err := os.OpenFile(s.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	// The child gets its own copy of the descriptor, so exec starts no
	// copying goroutine and logf can be closed right after Start.
	defer logf.Close()
	cmd := exec.Command(serverBinary, s.args...)
	cmd.Dir = s.dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	// This goroutine ends when the process exits; killLocked (run at the
	// latest by the cleanup) kills it and waits for done.
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	s.cmd, s.done = cmd, done
	return nil
}

// waitReadyLocked polls PING until the server answers PONG, it exits, or the
// deadline passes. Errors include the tail of the log.
func (s *Server) waitReadyLocked(deadline time.Time) error {
	c := &conn{addr: s.addrLocked()}
	defer c.close()
	var last error
	for {
		select {
		case <-s.done:
			return fmt.Errorf("%s on port %d exited during start-up (%v)\n%s", serverBinary, s.port, s.cmd.ProcessState, s.logTail())
		default:
		}
		v, err := c.do("PING")
		if err == nil && v == "PONG" {
			return nil
		}
		last = err
		if time.Now().After(deadline) {
			return fmt.Errorf("%s on port %d did not answer PING within %v (last error: %v)\n%s", serverBinary, s.port, waitTimeout, last, s.logTail())
		}
		time.Sleep(pollInterval)
	}
}

func (s *Server) logSize() int64 {
	fi, err := os.Stat(s.logPath)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// addrInUseSince reports whether the log, from offset off on, says a port
// could not be bound.
func (s *Server) addrInUseSince(off int64) bool {
	b, err := os.ReadFile(s.logPath)
	if err != nil || int64(len(b)) < off {
		return false
	}
	return bytes.Contains(b[off:], []byte("Address already in use"))
}

// logTail returns the last lines of the server's log.
func (s *Server) logTail() string {
	return "--- tail of " + s.logPath + " ---\n" + tail(s.logPath, 30, 4096)
}

func tail(path string, lines, maxBytes int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	if len(b) > maxBytes {
		b = b[len(b)-maxBytes:]
	}
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}

// startAll gives each server a fresh port, launches all of them, then waits
// for each to answer PING, so that they start in parallel. A server that
// fails because a port was taken in the meantime gets a new port, up to
// startAttempts times. On error every server of the batch is killed.
func startAll(servers []*Server) (err error) {
	defer func() {
		if err != nil {
			for _, s := range servers {
				s.Kill()
			}
		}
	}()
	launch := func(s *Server) error {
		s.mu.Lock()
		defer s.mu.Unlock()
		port, err := freePort(s.bus)
		if err != nil {
			return err
		}
		args, err := s.build(port)
		if err != nil {
			return err
		}
		s.port, s.args = port, args
		return s.launchLocked()
	}
	offsets := make([]int64, len(servers))
	for i, s := range servers {
		offsets[i] = s.logSize()
		if err := launch(s); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(waitTimeout)
	for i, s := range servers {
		for attempt := 1; ; attempt++ {
			s.mu.Lock()
			err := s.waitReadyLocked(deadline)
			if err != nil {
				s.killLocked()
			}
			s.mu.Unlock()
			if err == nil {
				break
			}
			if attempt >= startAttempts || !s.addrInUseSince(offsets[i]) {
				return err
			}
			offsets[i] = s.logSize()
			if err := launch(s); err != nil {
				return err
			}
		}
	}
	return nil
}

// usedPorts holds every port handed out by freePort in this process
// (including cluster bus ports), so that parallel tests never get the same
// port twice even if the kernel reuses it.
var usedPorts = struct {
	sync.Mutex
	m map[int]bool
}{m: map[int]bool{}}

// freePort returns a port on 127.0.0.1 that is free right now. With bus, the
// port is below maxClusterPort and port+busOffset is free too.
func freePort(bus bool) (int, error) {
	usedPorts.Lock()
	defer usedPorts.Unlock()
	ok := func(p int) bool {
		if p <= 0 || usedPorts.m[p] {
			return false
		}
		if bus && (p >= maxClusterPort || usedPorts.m[p+busOffset] || !canListen(p+busOffset)) {
			return false
		}
		return true
	}
	for i := 0; i < 100; i++ {
		var p int
		if i < 50 {
			// Let the kernel choose.
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return 0, err
			}
			p = l.Addr().(*net.TCPAddr).Port
			good := ok(p)
			_ = l.Close()
			if !good {
				continue
			}
		} else {
			// The ephemeral range may lie above maxClusterPort: try
			// random ports instead.
			p = 20000 + rand.IntN(maxClusterPort-20000)
			if !ok(p) || !canListen(p) {
				continue
			}
		}
		usedPorts.m[p] = true
		if bus {
			usedPorts.m[p+busOffset] = true
		}
		return p, nil
	}
	return 0, errors.New("no free port found on 127.0.0.1")
}

func canListen(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// poll calls check every pollInterval until it returns nil or waitTimeout
// passes, and returns check's last error.
func poll(check func() error) error {
	deadline := time.Now().Add(waitTimeout)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: %w", waitTimeout, err)
		}
		time.Sleep(pollInterval)
	}
}
