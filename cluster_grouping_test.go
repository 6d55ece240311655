package tollgate

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// BenchmarkClusterSlotGrouping measures what batching by hash slot could
// gather on a Redis Cluster (ADR 26), where one script call cannot span
// slots: 32 callers per -cpu decide on 10,000 keys on a cluster of 3
// masters that it starts, one script call each, as a store does today,
// and a hook notes, as each call is sent, how many calls then in flight
// share its slot and its node, itself included. A batcher that grouped
// the decisions under way by slot could put at most the first in one
// script call; the second is what grouping by node would offer if one
// call could span slots.
func BenchmarkClusterSlotGrouping(b *testing.B) {
	cl := redistest.StartCluster(b, 3, 0)
	c := cl.Client(b, &redis.ClusterOptions{PoolSize: 64})
	ctx := context.Background()
	shards, err := c.ClusterShards(ctx).Result()
	require.NoError(b, err)
	g := &slotGauge{}
	for i, shard := range shards {
		for _, r := range shard.Slots {
			for slot := r.Start; slot <= r.End; slot++ {
				g.node[slot] = i
			}
		}
	}
	c.AddHook(g)
	l, err := New(NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())), benchPlan)
	require.NoError(b, err)
	b.SetParallelism(32)
	allowParallel(b, l)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.calls > 0 {
		b.ReportMetric(float64(g.sameSlot)/float64(g.calls), "same-slot/call")
		b.ReportMetric(float64(g.sameNode)/float64(g.calls), "same-node/call")
		b.ReportMetric(float64(g.inFlight)/float64(g.calls), "in-flight/call")
	}
}

// slotGauge is a go-redis hook that counts, for each EVALSHA or FCALL
// sent (both hold their first key at args[3]), the calls in flight on its
// slot and on its node, itself included.
type slotGauge struct {
	node [16384]int // the index of the node serving each slot

	mu                                  sync.Mutex
	bySlot                              map[int]int
	byNode                              map[int]int
	now                                 int // calls in flight
	calls, sameSlot, sameNode, inFlight int64
}

func (g *slotGauge) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *slotGauge) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (g *slotGauge) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if !isScriptCmd(cmd) || len(args) < 4 {
			return next(ctx, cmd)
		}
		key, _ := args[3].(string)
		slot := keySlot(key)
		node := g.node[slot]
		g.mu.Lock()
		if g.bySlot == nil {
			g.bySlot, g.byNode = map[int]int{}, map[int]int{}
		}
		g.bySlot[slot]++
		g.byNode[node]++
		g.now++
		g.calls++
		g.sameSlot += int64(g.bySlot[slot])
		g.sameNode += int64(g.byNode[node])
		g.inFlight += int64(g.now)
		g.mu.Unlock()
		err := next(ctx, cmd)
		g.mu.Lock()
		g.bySlot[slot]--
		g.byNode[node]--
		g.now--
		g.mu.Unlock()
		return err
	}
}

// keySlot returns the Redis Cluster hash slot of key: CRC16 (XMODEM) of
// its hash tag, or of the whole key if it has none, modulo 16384.
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc ^= uint16(key[k]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}
