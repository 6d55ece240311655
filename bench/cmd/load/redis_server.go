package main

import (
	"context"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// freshRedis starts an empty redis-server on a free loopback port, run by
// the command wrapper if any (such as valgrind), and returns a client of
// it, the server's process and a function that stops it.
func freshRedis(wrapper ...string) (*redis.Client, *os.Process, func()) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	args := append(wrapper, "redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	cmd := exec.Command(args[0], args[1:]...)
	if err := cmd.Start(); err != nil {
		log.Fatalf("the measures need %s on PATH: %v", args[0], err)
	}
	addr := fmt.Sprint("127.0.0.1:", port)
	for i := 0; ; i++ { // a client would log each refused dial
		conn, err := net.Dial("tcp", addr)
		if err == nil {
			conn.Close()
			break
		}
		if i == 1000 {
			log.Fatal("redis-server did not start")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 128})
	return c, cmd.Process, func() {
		_ = c.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}

// redisCPU returns the CPU seconds the Redis server has used, user and
// system, from INFO cpu: the server's cost per decision, whatever else
// runs on the machine.
func redisCPU(c *redis.Client) float64 {
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		log.Fatal(err)
	}
	total := 0.0
	for _, line := range strings.Split(info, "\r\n") {
		for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(line, f); ok {
				x, _ := strconv.ParseFloat(v, 64)
				total += x
			}
		}
	}
	return total
}

func usedMemory(ctx context.Context, c *redis.Client) int64 {
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		log.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	log.Fatal("no used_memory in INFO")
	return 0
}
