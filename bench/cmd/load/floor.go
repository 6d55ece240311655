package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// floorBatch is how many keys one call of a floor script decides on.
const floorBatch = 32

// floors are scripts that do no more in Redis than any decision on a
// bucket must, for each of floorBatch keys in one call: read Redis TIME
// once, then GET and SET … PX. floor-parse also reads a number from the
// value and refills it, with nothing but arithmetic. A decision's Redis
// CPU is measured against them.
var floors = []struct{ name, src string }{
	{"floor", `local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
for i = 1, #KEYS do
  redis.call('GET', KEYS[i])
  redis.call('SET', KEYS[i], 'x', 'PX', '1000000')
end
return 1`},
	{"floor-parse", `local time = redis.call('TIME')
local now = time[1] * 1000000 + time[2]
local full, rate = ARGV[1] * 1000000, ARGV[2] + 0
local format = string.format
for i = 1, #KEYS do
  local v = redis.call('GET', KEYS[i])
  local t = full
  if v then
    t = v + 0 + (now - ARGV[3]) * rate
    if t > full then t = full end
  end
  t = t - 1000000
  redis.call('SET', KEYS[i], format('%d', t), 'PX', format('%d', (full - t) / rate / 1000 + 2))
end
return 1`},
}

// floorCalls runs calls calls of the floor script src on c, each on the
// next floorBatch keys, with prefix before each, from one serial client.
func floorCalls(c *redis.Client, src, prefix string, keys []string, calls int) {
	ctx := context.Background()
	sha, err := c.ScriptLoad(ctx, src).Result()
	if err != nil {
		log.Fatal(err)
	}
	batch := make([]string, floorBatch)
	next := 0
	for range calls {
		for i := range batch {
			batch[i] = prefix + keys[next%len(keys)]
			next++
		}
		if err := c.EvalSha(ctx, sha, batch, burst, perSec, 0).Err(); err != nil {
			log.Fatal(err)
		}
	}
}

// floorCPU prints the floor scripts' Redis CPU per key on the Redis of
// opt, the measure decisions' redis-cpu is set beside.
func floorCPU(opt *redis.Options, keys []string, calls int) {
	c := redis.NewClient(opt)
	defer c.Close()
	for _, f := range floors {
		floorCalls(c, f.src, f.name+":", keys, calls/4) // the keys exist from here
		before := redisCPU(c)
		floorCalls(c, f.src, f.name+":", keys, calls)
		perKey := (redisCPU(c) - before) / float64(calls*floorBatch)
		fmt.Printf("%-22s %7s %12s %10s %10s %10s %7s %11s\n", f.name, "1", "", "", "", "", "", fmt.Sprintf("%.2fµs", perKey*1e6))
	}
}

// floorInstructions prints the floor scripts' redis-server instructions
// per key in callgrind, each on a fresh server, as instructions does for
// the contenders.
func floorInstructions(keys []string, n int) {
	for _, f := range floors {
		dir, err := os.MkdirTemp("", "tollgate-callgrind")
		if err != nil {
			log.Fatal(err)
		}
		out := filepath.Join(dir, "cg")
		c, server, stop := freshRedis("valgrind", "--tool=callgrind", "--callgrind-out-file="+out)
		calls := n / floorBatch
		floorCalls(c, f.src, f.name+":", keys, calls/4)
		if err := exec.Command("callgrind_control", "-z", strconv.Itoa(server.Pid)).Run(); err != nil {
			log.Fatal(err)
		}
		floorCalls(c, f.src, f.name+":", keys, calls)
		if err := exec.Command("callgrind_control", "-d", strconv.Itoa(server.Pid)).Run(); err != nil {
			log.Fatal(err)
		}
		stop()
		fmt.Printf("%-22s %.0f\n", f.name, float64(callgrindTotal(out+".1"))/float64(calls*floorBatch))
		_ = os.RemoveAll(dir)
	}
}
