package tollgate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"sync/atomic"
	"time"
)

// Defaults and bounds of WithFleet's interval, and the largest fleet
// counted.
const (
	defaultFleetInterval = 5 * time.Second
	minFleetInterval     = 10 * time.Millisecond
	maxFleetSize         = 65_536
	// fleetTTLBeats is how many intervals an instance counts as alive
	// after its last heartbeat, and how many heartbeats' counts the size
	// is the largest of.
	fleetTTLBeats = 3
)

// fleet is a Limiter's heartbeat and the fleet's size last seen. It is
// safe for concurrent use.
type fleet struct {
	store    fleetStore
	id       string
	interval time.Duration
	ttl      time.Duration
	size     atomic.Int64         // instances alive last seen; 0 before the first heartbeat
	counts   [fleetTTLBeats]int64 // of the last heartbeats, newest first; only beat uses them

	// alive is the context of the heartbeats, which close ends: it stops
	// them, and ends one under way on a store that hangs.
	alive context.Context
	end   context.CancelFunc
	done  chan struct{} // closed when run returns
}

// newFleet checks s and returns the fleet of an instance on store, not
// yet started.
func newFleet(store Store, interval time.Duration) (*fleet, error) {
	fs, ok := store.(fleetStore)
	if !ok {
		return nil, fmt.Errorf("%w: WithFleet needs a store the fleet shares, such as a RedisStore", ErrInvalidOption)
	}
	if interval == 0 {
		interval = defaultFleetInterval
	}
	if interval < minFleetInterval || interval > maxRefillPeriod {
		return nil, fmt.Errorf("%w: fleet interval must be at least %v", ErrInvalidOption, minFleetInterval)
	}
	var id [8]byte
	_, _ = rand.Read(id[:]) // never fails (crypto/rand)
	alive, end := context.WithCancel(context.Background())
	return &fleet{
		store: fs, id: hex.EncodeToString(id[:]), interval: interval, ttl: fleetTTLBeats * interval,
		alive: alive, end: end, done: make(chan struct{}),
	}, nil
}

// run beats every interval until close, the first time at once.
func (f *fleet) run() {
	defer close(f.done)
	t := time.NewTicker(f.interval)
	defer t.Stop()
	for {
		ctx, cancel := context.WithTimeout(f.alive, f.interval)
		_ = f.beat(ctx) // a failed beat keeps the size last seen
		cancel()
		select {
		case <-f.alive.Done():
			return
		case <-t.C:
		}
	}
}

// beat records that this instance is alive and reads the fleet's size:
// the most instances its last fleetTTLBeats heartbeats counted. A Redis
// that lost the fleet's set (restarted empty) counts only the instances
// that beat since, and each beats again within an interval: until then
// a smaller count would give each fallback too large a share. An
// instance that stops leaves the count once its own TTL and f.ttl have
// both passed since its last heartbeat, and the size f.ttl later.
func (f *fleet) beat(ctx context.Context) error {
	n, err := f.store.heartbeat(ctx, f.id, f.ttl)
	if err != nil {
		return err
	}
	copy(f.counts[1:], f.counts[:])
	f.counts[0] = min(n, maxFleetSize)
	f.size.Store(slices.Max(f.counts[:]))
	return nil
}

// check records one heartbeat, as beat does, but leaves the size as it
// was: Limiter.Check's proof that the fleet can count this instance.
func (f *fleet) check(ctx context.Context) error {
	if _, err := f.store.heartbeat(ctx, f.id, f.ttl); err != nil {
		return fmt.Errorf("the fleet's heartbeat: %w", err)
	}
	return nil
}

// close stops the heartbeat, ends a heartbeat under way, and waits for
// it; later calls return at once.
func (f *fleet) close() {
	f.end()
	<-f.done
}

// shareOf returns the plans an instance's fallback enforces: each plan's
// share of a fleet of n instances, the Capacity at least cost; plans
// themselves for an instance alone.
func shareOf(plans []Plan, n, cost int64) []Plan {
	if n <= 1 {
		return plans
	}
	shares := make([]Plan, len(plans))
	for i, p := range plans {
		p.Capacity = max(p.Capacity/n, cost, 1)
		if !p.isWindow() && !p.Concurrency {
			p.Rate = max(p.Rate/float64(n), float64(p.Capacity)/maxRefillPeriod.Seconds())
		}
		shares[i] = p
	}
	return shares
}

// fallbackShare returns the plans a settlement on the fallback adjusts:
// this instance's share of each (WithFleet), as the fallback decides one
// token. Not the share a reservation of n was decided on, whose capacity
// share lifts to n: a debt as long as that capacity allows would be more
// than the next decision's share could read, which brings it back to one
// refill of the share and forgives the rest.
func (l *Limiter) fallbackShare(plans []Plan) []Plan {
	return shareOf(plans, l.fleetSize(), 1)
}

// fleetSize returns the instances alive last seen: 1 without WithFleet or
// before the first heartbeat.
func (l *Limiter) fleetSize() int64 {
	if l.fleet == nil {
		return 1
	}
	return max(l.fleet.size.Load(), 1)
}
