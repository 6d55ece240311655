package redistest

import (
	"context"
	"syscall"
	"testing"
	"time"
)

func TestServerSignalStopsAndContinues(t *testing.T) {
	s := StartServer(t)
	opt := FailFast(s.Addr())
	c := NewClient(t, opt)
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	s.Signal(syscall.SIGSTOP)
	if err := c.Ping(ctx).Err(); err == nil {
		t.Fatal("PING answered while the server was stopped")
	}
	s.Signal(syscall.SIGCONT)
	var err error
	for range 50 { // the stopped server may answer the timed-out PING first
		if err = c.Ping(ctx).Err(); err == nil {
			return
		}
		time.Sleep(pollInterval)
	}
	t.Fatalf("PING after SIGCONT: %v", err)
}
