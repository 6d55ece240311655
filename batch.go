package tollgate

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Batching limits: a batch holds at most maxBatch decisions, and at most
// maxInFlight script calls of one store are under way at once, so that
// Redis runs one batch while the next is on its way.
const (
	maxBatch    = 32
	maxInFlight = 2
)

// batchCalls has s decide concurrent requests in batches (WithBatching),
// unless its client spreads keys over slots that one script call cannot
// span: a ClusterClient or Ring.
func (s *RedisStore) batchCalls() {
	switch s.client.(type) {
	case *redis.ClusterClient, *redis.Ring:
		return
	}
	s.batch = &batcher{client: s.client, scripts: s.scripts}
}

// batcher gathers the decisions of one RedisStore into batches. It is safe
// for concurrent use.
type batcher struct {
	client  redis.UniversalClient
	scripts *decisionScripts

	mu       sync.Mutex
	pending  []*scriptCall // waiting for a call slot, oldest first
	inFlight int           // script calls under way, at most maxInFlight
}

// eval runs the limit script for the decision c and returns its reply:
// through the batcher if there is one. It recycles c once nothing else
// can read it.
func (s *RedisStore) eval(ctx context.Context, c *scriptCall) (any, error) {
	if s.batch == nil {
		reply, err := s.scripts.runOne(ctx, s.client, c)
		c.recycle()
		return reply, err
	}
	return s.batch.do(ctx, c)
}

// do decides one request: at once on the caller's goroutine if a call slot
// is free and nobody waits, or else in the next batch. It recycles c
// unless c is left to a sender after its caller gave up.
func (b *batcher) do(ctx context.Context, c *scriptCall) (any, error) {
	b.mu.Lock()
	if b.inFlight < maxInFlight && len(b.pending) == 0 {
		b.inFlight++
		b.mu.Unlock()
		reply, err := b.scripts.runOne(ctx, b.client, c)
		c.recycle()
		b.release()
		return reply, err
	}
	c.ctx = ctx
	b.pending = append(b.pending, c)
	if b.inFlight < maxInFlight {
		b.inFlight++
		go b.flush()
	}
	b.mu.Unlock()
	select {
	case <-c.done:
		reply, err := c.Reply, c.Err
		c.recycle()
		return reply, err
	case <-ctx.Done():
		// Still waiting, it is withdrawn; already sent, its answer is
		// dropped, and c with it, since a sender may still write to it.
		b.mu.Lock()
		for i, p := range b.pending {
			if p == c {
				b.pending = append(b.pending[:i], b.pending[i+1:]...)
				break
			}
		}
		b.mu.Unlock()
		return nil, ctx.Err()
	}
}

// release ends a script call: its slot passes to a sender of the waiting
// decisions if there are any.
func (b *batcher) release() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.pending) > 0 {
		go b.flush()
		return
	}
	b.inFlight--
}

// flush sends the waiting decisions, a batch at a time, until none wait,
// and then gives up its call slot.
func (b *batcher) flush() {
	for {
		b.mu.Lock()
		n := min(len(b.pending), maxBatch)
		if n == 0 {
			b.inFlight--
			b.mu.Unlock()
			return
		}
		batch := make([]*scriptCall, n)
		copy(batch, b.pending)
		rest := copy(b.pending, b.pending[n:])
		clear(b.pending[rest:])
		b.pending = b.pending[:rest]
		b.mu.Unlock()
		b.send(batch)
	}
}

// send decides a batch in one script call and hands each caller its
// answer. Callers whose context has ended are left out: a decision takes
// nothing for them.
func (b *batcher) send(batch []*scriptCall) {
	live := make([]*scriptCall, 0, len(batch))
	var latest time.Time
	bounded := true
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.Err = err
			continue
		}
		live = append(live, c)
		dl, ok := c.ctx.Deadline()
		bounded = bounded && ok
		if dl.After(latest) {
			latest = dl
		}
	}
	ctx := context.Background()
	if bounded {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, latest)
		defer cancel()
	}
	b.scripts.runMany(ctx, b.client, live)
	for _, c := range batch {
		c.done <- struct{}{}
	}
}
