#!/usr/bin/env bash
# Compares the root package's benchmarks at two commits in interleaved
# rounds, on one redis-server both share, and prints benchstat's table.
#
#   bench/before-after.sh BEFORE AFTER [ROUNDS] [PATTERN...]
#
# BEFORE and AFTER are commits (AFTER may be "." for the work tree). The
# default patterns are the decision paths: memory one key and chained,
# Redis client-only and parallel, batched, leased. Needs redis-server and
# benchstat (go install golang.org/x/perf/cmd/benchstat@latest).
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 rounds=${3:-8}
shift $(( $# < 3 ? $# : 3 ))
pats=("$@")
if [ ${#pats[@]} -eq 0 ]; then
  pats=('^BenchmarkLimiterAllow$/^(memory|redis)$/^(one-key|chained|client-only|parallel)$'
        '^BenchmarkRedisBatching$/^batched$'
        '^BenchmarkLease$/^(serial|parallel)$/^lease$')
fi
dir=$(mktemp -d)
build() { # build REV NAME
  if [ "$1" = . ]; then go test -c -o "$dir/$2.test" .; return; fi
  git worktree add -q --detach "$dir/src-$2" "$1"
  (cd "$dir/src-$2" && go test -c -o "$dir/$2.test" .)
  git worktree remove --force "$dir/src-$2"
}
build "$before" before
build "$after" after
port=$(( 20000 + RANDOM % 20000 ))
redis-server --port "$port" --save '' --appendonly no --daemonize yes --pidfile "$dir/redis.pid" >/dev/null
trap 'kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; rm -rf "$dir"' EXIT
sleep 0.5
export TOLLGATE_REDIS_ADDR=127.0.0.1:$port
for _ in $(seq "$rounds"); do
  for side in before after; do
    for pat in "${pats[@]}"; do
      "$dir/$side.test" -test.run '^$' -test.bench "$pat" -test.benchmem -test.benchtime 1s >> "$dir/$side.txt" 2>/dev/null
    done
  done
done
benchstat "$dir/before.txt" "$dir/after.txt"
