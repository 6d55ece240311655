// Package scripts embeds tollgate's Lua scripts, so that the stores that
// run them and the tests that check them read the same text. Each script's
// header documents its KEYS, ARGV and reply.
package scripts

import _ "embed"

// bucket holds the token bucket's functions that Limit and Settle share.
//
//go:embed bucket.lua
var bucket string

//go:embed limit.lua
var limit string

//go:embed settle.lua
var settle string

// Limit decides on every chained plan of one key, token buckets and
// sliding windows alike, in one atomic step, and records a reservation's
// hold; TokenBucket, window and chain in package tollgate hold the same
// arithmetic.
var Limit = bucket + limit

// BucketFunctions is the prelude of Limit and Settle: bucket.lua, which
// only defines functions and the clock they read, so a frame that runs
// Limit many times in one script call (redisscript.Batch) makes them once
// and reads Redis TIME once.
var BucketFunctions = bucket

// LimitBody is Limit without its prelude, BucketFunctions.
var LimitBody = limit

// Settle settles a reservation's hold on the buckets of one key: it
// refunds what was held and not used, or charges what was used beyond it.
var Settle = bucket + settle

// CircuitBreaker runs one step of a distributed circuit breaker on its one
// key; circuit in package breaker holds the same state machine.
//
//go:embed circuit_breaker.lua
var CircuitBreaker string

// Fleet records one heartbeat of a Limiter's instance and counts the
// instances alive, for the fallback's share during an outage.
//
//go:embed fleet.lua
var Fleet string
