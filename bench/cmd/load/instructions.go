package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// instructions counts the instructions redis-server runs per decision, in
// callgrind, for each contender on a fresh server of its own: n decisions
// on keys from 64 callers, on clients of the given pool size (as -pool;
// 0 is go-redis's default), after n/4 that load the scripts and create the
// keys. Unlike time, the count does not depend on what else the machine
// runs, so it shows a change to the scripts that timing noise would hide.
func instructions(active []contender, keys []string, n, pool int) {
	fmt.Printf("\n%-22s %s\n", "contender", "redis-server instructions per decision (callgrind, 64 callers)")
	for _, ct := range active {
		dir, err := os.MkdirTemp("", "tollgate-callgrind")
		if err != nil {
			log.Fatal(err)
		}
		out := filepath.Join(dir, "cg")
		c, server, stop := freshRedis("valgrind", "--tool=callgrind", "--callgrind-out-file="+out)
		decide, cleanup := ct.setup(&redis.Options{Addr: c.Options().Addr, PoolSize: pool}, "i:")
		decideN(decide, keys, 64, n/4)
		control := func(flag string) {
			if err := exec.Command("callgrind_control", flag, strconv.Itoa(server.Pid)).Run(); err != nil {
				log.Fatalf("callgrind_control %s: %v", flag, err)
			}
		}
		control("-z") // counts from here
		decideN(decide, keys, 64, n)
		control("-d") // writes out.1
		cleanup()
		stop()
		fmt.Printf("%-22s %.0f\n", ct.name, float64(callgrindTotal(out+".1"))/float64(n))
		_ = os.RemoveAll(dir)
	}
}

// decideN makes n decisions on keys from callers goroutines.
func decideN(decide decider, keys []string, callers, n int) {
	var seq atomic.Int64
	var wg sync.WaitGroup
	for range callers {
		wg.Go(func() {
			for i := seq.Add(1); i <= int64(n); i = seq.Add(1) {
				if err := decide(context.Background(), keys[int(i)%len(keys)]); err != nil {
					log.Fatal(err)
				}
			}
		})
	}
	wg.Wait()
}

// callgrindTotal reads the instructions counted in a callgrind dump.
func callgrindTotal(path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		log.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "summary: "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				log.Fatalf("callgrind summary %q: %v", v, err)
			}
			return n
		}
	}
	log.Fatalf("no summary in %s", path)
	return 0
}
