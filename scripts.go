package tollgate

import _ "embed"

// The Lua scripts the RedisStore runs, read from scripts/ when the package
// is built, so that the store and the tests that check them read the same
// text. Each script's header documents its KEYS, ARGV and reply.
var (
	// luaBucket holds the token bucket's functions and the clock they
	// read, which luaLimit and luaSettle share: the prelude of both, which
	// a batch (redisscript.Batch) runs once for many decisions.
	//
	//go:embed scripts/bucket.lua
	luaBucket string

	// luaSemaphore holds the functions on a concurrency plan's permits,
	// which luaLimit and luaPermit share, after luaBucket.
	//
	//go:embed scripts/semaphore.lua
	luaSemaphore string

	// luaPermit releases or renews the permits of a key's concurrency
	// plans (Permit.Release, and a Limiter's renewals).
	//
	//go:embed scripts/permit.lua
	luaPermit string

	// luaLimit decides on every chained plan of one key, token buckets and
	// sliding windows alike, in one atomic step, and records a
	// reservation's hold; TokenBucket, window and chain hold the same
	// arithmetic.
	//
	//go:embed scripts/limit.lua
	luaLimit string

	// luaTake decides on one token bucket plan without a version, not
	// shadowed, without a hold, as luaLimit does, with less work in
	// Redis: one decision, or a batch of them.
	//
	//go:embed scripts/take.lua
	luaTake string

	// luaSettle settles a reservation's hold on the buckets of one key: it
	// refunds what was held and not used, or charges what was used beyond
	// it.
	//
	//go:embed scripts/settle.lua
	luaSettle string

	// luaReset resets the buckets of one key and marks when, so that the
	// settlements of holds taken before refund nothing.
	//
	//go:embed scripts/reset.lua
	luaReset string

	// luaFleet records one heartbeat of a Limiter's instance and counts
	// the instances alive, for the fallback's share during an outage.
	//
	//go:embed scripts/fleet.lua
	luaFleet string
)

// settleScript is the script a settlement runs, with the bucket's
// functions before it; decisionScriptsOn builds a decision's.
var settleScript = luaBucket + luaSettle

// resetScript is the script a Reset runs, with the bucket's functions
// (its clock) before it.
var resetScript = luaBucket + luaReset

// permitScript is the script a release or renewal runs.
var permitScript = luaBucket + luaSemaphore + luaPermit
