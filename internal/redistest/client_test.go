package redistest

import (
	"context"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestFailFast(t *testing.T) {
	port, err := freePort(false) // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	c := NewClient(t, FailFast(addr))
	began := time.Now()
	err = c.Ping(context.Background()).Err()
	took := time.Since(began)
	if err == nil {
		t.Fatal("PING of a closed port succeeded")
	}
	// One refused dial and no retry: under a millisecond. go-redis's
	// defaults (3 retries of 5 dials each) take over a second here, so the
	// bound tells them apart with room for a loaded machine.
	if took > 500*time.Millisecond {
		t.Fatalf("PING of a closed port took %v, want one dial and no retry", took)
	}
}

func TestNewClientClosesAtCleanup(t *testing.T) {
	addr := Addr(t)
	var c *redis.Client
	t.Run("use", func(t *testing.T) {
		c = NewClient(t, &redis.Options{Addr: addr})
		if err := c.Ping(context.Background()).Err(); err != nil {
			t.Fatalf("PING: %v", err)
		}
	})
	if err := c.Ping(context.Background()).Err(); err != redis.ErrClosed {
		t.Fatalf("PING after the test ended = %v, want %v", err, redis.ErrClosed)
	}
}

func TestTime(t *testing.T) {
	c := StartServer(t).Client(t) // Addr may name a server on another machine
	before := time.Now().UnixMicro()
	got := Time(t, c)
	after := time.Now().UnixMicro()
	// The server runs on this machine, so its clock is this one, and
	// microseconds must not be read as seconds or nanoseconds.
	if slack := int64(time.Second / time.Microsecond); got < before-slack || got > after+slack {
		t.Fatalf("Time = %d µs, want within a second of [%d, %d]", got, before, after)
	}
}

func TestKeyPrefix(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		p := KeyPrefix()
		if seen[p] {
			t.Fatalf("KeyPrefix returned %q twice", p)
		}
		seen[p] = true
		// A prefix goes before a Cluster hash tag: it must hold none.
		if strings.ContainsAny(p, "{} \r\n") {
			t.Fatalf("KeyPrefix() = %q: no braces or spaces", p)
		}
	}
}
