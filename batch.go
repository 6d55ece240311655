package tollgate

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxBatch is the most decisions one script call decides; minCalls and
// maxCalls the fewest and the most script calls a batcher lets be under
// way at once. Two let Redis run one call while the next one travels;
// more than 16 only queue in Redis, which runs one call at a time, where
// they would have ridden a batch.
const (
	maxBatch = 32
	minCalls = 2
	maxCalls = 16
)

// batchCalls has s decide concurrent requests in batches if its client
// talks to one server, as a *redis.Client (standalone or Sentinel), or a
// client that embeds one, does. Any other may spread keys over slots that
// one script call cannot span: a ClusterClient, a Ring, or a client that
// hides one, such as an auto-pipeliner of a ClusterClient.
func (s *RedisStore) batchCalls() {
	if _, ok := s.client.(interface{ Options() *redis.Options }); !ok {
		return
	}
	slots := callSlots(s.client)
	s.batch = &batcher{client: s.client, scripts: s.scripts, slots: slots, limit: slots}
}

// callSlots returns how many script calls a batcher on client may keep
// under way at once: the client's pool size, so that a decision never
// waits for a batch where a call of its own would have found a free
// connection at once, from minCalls to maxCalls.
func callSlots(client redis.UniversalClient) int {
	pool := 10 * runtime.GOMAXPROCS(0) // go-redis's default pool size
	if c, ok := client.(interface{ Options() *redis.Options }); ok && c.Options().PoolSize > 0 {
		pool = c.Options().PoolSize
	}
	return min(max(pool, minCalls), maxCalls)
}

// batcher gathers the decisions of one RedisStore into batches. A decision
// that finds fewer than limit calls under way, and none waiting, is sent
// at once, alone; one that finds the limit reached waits, and the caller
// whose call ends next passes its slot to the first waiting decision,
// whose caller sends every decision then waiting, up to maxBatch, in one
// call. The waiting callers send the batches, on a goroutine that lives
// for the call if the sender's context can end.
//
// The limit follows the load: a call that ends while decisions wait
// lowers it by one, towards minCalls, and gives its slot up rather than
// pass it on while more calls than the limit are under way, so that
// under a load Redis cannot keep up with the waiting decisions ride in
// few, large batches; a call that ends while none wait raises it by one,
// up to slots, so that under a light load every decision goes alone. It
// is safe for concurrent use.
type batcher struct {
	client  redis.UniversalClient
	scripts *decisionScripts
	slots   int // script calls under way at once, at most

	mu       sync.Mutex
	pending  []*scriptCall // waiting for a call slot, oldest first
	inFlight int           // script calls under way; at least 1 while any wait
	limit    int           // calls a decision may find under way and go alone, minCalls to slots
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

// do decides one request: at once if a call slot is free, or else in a
// batch. It recycles c unless c is left to a sender after its caller gave
// up.
func (b *batcher) do(ctx context.Context, c *scriptCall) (any, error) {
	b.mu.Lock()
	if b.inFlight < b.limit && len(b.pending) == 0 {
		b.inFlight++
		b.mu.Unlock()
		reply, err := b.scripts.runOne(ctx, b.client, c)
		c.recycle()
		b.release()
		return reply, err
	}
	c.ctx, c.lead = ctx, false
	b.pending = append(b.pending, c)
	b.mu.Unlock()
	select {
	case <-c.done:
		if c.lead {
			return b.lead(ctx, c)
		}
		return c.answer()
	case <-ctx.Done():
		if b.withdraw(c) {
			return nil, &leftBatch{err: ctx.Err(), sent: c.done}
		}
		return nil, ctx.Err()
	}
}

// leftBatch is the error of a decision whose caller gave up once its
// batch was on its way: the caller's context's error, and a channel that
// receives once the batch's reply is in, which Redis may have granted.
// A release of what it took must wait for it, or it may reach Redis
// first and release nothing.
type leftBatch struct {
	err  error
	sent <-chan struct{}
}

func (e *leftBatch) Error() string { return e.err.Error() }
func (e *leftBatch) Unwrap() error { return e.err }

// leftOf returns, for a decision whose batch was on its way when its
// caller gave up, the channel that receives once the batch's reply is in,
// else nil; and err, the error of its script call, as its caller's
// context gave it.
func leftOf(err error) (<-chan struct{}, error) {
	if e, ok := err.(*leftBatch); ok {
		return e.sent, e.err
	}
	return nil, err
}

// release ends a script call: its slot passes to the first waiting
// decision, if any, whose caller sends the next batch.
func (b *batcher) release() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.passSlot()
}

// passSlot is release with b.mu held.
func (b *batcher) passSlot() {
	if len(b.pending) == 0 {
		b.limit = min(b.limit+1, b.slots)
		b.inFlight--
		return
	}
	b.limit = max(b.limit-1, minCalls)
	if b.inFlight > b.limit { // the waiting decisions ride the calls under way
		b.inFlight--
		return
	}
	next := b.pending[0]
	b.pending[0] = nil
	b.pending = b.pending[1:]
	next.lead = true
	next.done <- struct{}{}
}

// answer returns the reply and error a batch set in c, and recycles c.
func (c *scriptCall) answer() (any, error) {
	reply, err := c.Reply, c.Err
	c.recycle()
	return reply, err
}

// lead sends the batch of c, which was given a call slot, passes the slot
// on, and returns c's answer. A caller whose context can end sends it on
// a goroutine, so that the call does not hold it once its context ends:
// it then gets its context's error, as a caller waiting in a batch does,
// and its answer is dropped.
func (b *batcher) lead(ctx context.Context, c *scriptCall) (any, error) {
	batch := b.gather(c)
	if ctx.Done() == nil {
		b.send(batch)
		b.release()
		return c.answer()
	}
	go func() {
		b.send(batch)
		b.release()
		c.done <- struct{}{}
	}()
	select {
	case <-c.done:
		return c.answer()
	case <-ctx.Done():
		return nil, &leftBatch{err: ctx.Err(), sent: c.done}
	}
}

// gather returns the batch of c: c and the decisions waiting behind it,
// up to maxBatch, which it takes out of the waiting ones.
func (b *batcher) gather(c *scriptCall) []*scriptCall {
	b.mu.Lock()
	n := min(len(b.pending), maxBatch-1)
	batch := make([]*scriptCall, 1, n+1)
	batch[0] = c
	batch = append(batch, b.pending[:n]...)
	rest := copy(b.pending, b.pending[n:])
	clear(b.pending[rest:])
	b.pending = b.pending[:rest]
	b.mu.Unlock()
	return batch
}

// withdraw takes c, whose caller gave up, out of the batcher, and
// reports whether it was already sent: still waiting, it is withdrawn,
// and recycled; given a slot, it passes the slot on; already sent, its
// answer is dropped, and c with it, since a sender still writes to it:
// its done receives once the batch's reply is in.
func (b *batcher) withdraw(c *scriptCall) (sent bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, p := range b.pending {
		if p == c {
			b.pending = append(b.pending[:i], b.pending[i+1:]...)
			c.recycle()
			return false
		}
	}
	if c.lead {
		<-c.done // sent by passSlot, under b.mu
		b.passSlot()
		c.recycle()
		return false
	}
	return true
}

// send decides a batch in one script call and hands each caller but the
// first, which sends it, its answer. Callers whose context has ended are
// left out: a decision takes nothing for them.
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
	for _, c := range batch[1:] {
		c.done <- struct{}{}
	}
}
