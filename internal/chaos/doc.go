// Package chaos holds tollgate's chaos suite, which shows its guarantees
// under faults: several processes on one Redis, a Cluster master killed, a
// Sentinel failover, a restart, a SCRIPT FLUSH and FUNCTION FLUSH storm, a
// paused Redis, a flood of keys, and no goroutine left behind. It uses tollgate's exported
// API only, as a service would. It starts its own redis-server processes
// on free loopback ports (internal/redistest) and stops them at the end of
// each test.
//
// The suite is in test files behind the build tag chaos, so that
// go test ./... stays fast; this file only names the package:
//
//	go test -tags chaos -run Chaos -count=1 -v ./internal/chaos                         # short: CI
//	TOLLGATE_CHAOS_FULL=1 go test -tags chaos -run Chaos -count=1 -v -timeout 30m ./internal/chaos
//	TOLLGATE_CHAOS_UNBATCHED=1 go test -tags chaos -run Chaos -count=1 -v ./internal/chaos   # every RedisStore WithoutBatching
//	TOLLGATE_CHAOS_LEASE=1 go test -tags chaos -run ChaosProcesses -count=1 -v ./internal/chaos   # the processes' plan leased
//
// Every scenario logs one line "CHAOS scenario=… admitted=… bound=… …" with
// its figures: grep CHAOS.
//
// How the bound is counted. A decision's admission is charged to whoever
// made it:
//   - Redis (SourceStore, and SourceCache: the Limiter's denial cache only
//     repeats Redis's denials): per key, at most capacity × (1 + lost) + rate ×
//     elapsed, elapsed from Redis TIME read before the load starts and after
//     it ends. lost counts the events that make Redis forget a key's bucket
//     (a restart without persistence, a failover to a replica that may lag the
//     master): each may hand back at most one full bucket.
//   - each instance's fallback MemoryStore (SourceFallback): per key, at most
//     capacity + rate × the time between that instance's first and last
//     fallback decision on the key. This is what the Fallback policy allows:
//     one plan per instance for the outage.
//
// The assertions hold each part to its own bound, which is stricter than the
// sum the CHAOS line reports.
package chaos
