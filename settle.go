package tollgate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// settleStatus is what a store found of a hold it settled.
type settleStatus int

const (
	holdLive    settleStatus = iota // settled: refunded, or charged the excess
	holdSettled                     // settled before: nothing changed
	holdGone                        // expired or lost: only the excess charged
	holdBad                         // data not ours: settled as gone
	holdReset                       // live, but taken before its key's Reset: the excess charged, nothing refunded
)

// settlement describes the settlement o, of o.n tokens reserved and o.used
// used on o.plans, whose buckets are as stored after it, and which found
// the hold as status says. lost is the largest charge, in micro-tokens, that a
// bucket could not take.
func settlement(o settleOp, buckets []TokenBucket, now, lost int64, status settleStatus) Settlement {
	n, actual := o.n, o.used
	st := Settlement{Result: newResult(&outcome{plans: o.plans, buckets: buckets, now: now, allowed: true})}
	switch {
	case status == holdLive && actual < n:
		st.Refunded = n - actual
	case status != holdSettled && actual > n: // holdReset too
		st.Charged = actual - n
		st.Uncharged = lost / microTokens
	}
	return st
}

// settleDelta returns the micro-tokens a settlement adds to each bucket:
// a refund of what was not used if the hold is live, and otherwise a
// charge of what was used beyond it, if anything. scripts/settle.lua
// computes the same.
func settleDelta(n, actual int64, status settleStatus) int64 {
	if status == holdLive || status != holdSettled && actual > n {
		return (n - actual) * microTokens
	}
	return 0
}

// settle settles the hold of o: a reservation of o.n tokens on o.plans
// for o.key, of which o.used were used, with a hold that expires at
// hold.expires (µs on the store's clock; 0 for one held elsewhere, which
// reads as gone), taken at hold.at. A hold taken at or before its key's
// latest Reset (resetHolds) is refunded nothing. Bit i of hold.skip
// leaves plan i alone: the reservation took nothing from it. The hold
// itself is the Reservation, in this process, which settles only once.
func (m *MemoryStore) settle(_ context.Context, o settleOp) (Settlement, settleStatus, error) {
	key, plans, skip, n, actual := o.key, o.plans, o.hold.skip, o.n, o.used
	var buf [4]TokenBucket
	buckets := buf[:0]
	lk, now := m.lock(key)
	e := lk.e
	status := holdLive
	switch {
	case now >= o.hold.expires: // as a key with that expiry would have gone
		status = holdGone
	case lk.s.marks.voids(key, o.hold.at, now): // under the key's lock, as Reset marks it
		status = holdReset
	}
	delta := settleDelta(n, actual, status)
	if delta != 0 && e == nil {
		e = lk.insert(m, key, len(plans), now)
	}
	var lost int64
	for i := range plans {
		p := &plans[i]
		b := e.bucket(p, now)
		if delta != 0 && skip&(1<<i) == 0 {
			var u int64
			b, u = b.adjust(*p, now, delta)
			e.store(p, b)
			lost = max(lost, u)
		}
		buckets = append(buckets, b)
	}
	lk.unlock()
	return settlement(o, buckets, now, lost, status), status, nil
}

// hold is take for Reserve: the script also sets the hold, named by a new
// random id, in the key's hash slot, if it takes the tokens. A call that
// fails but may have run in Redis all the same, or may yet, is given back
// by that id (giveBackLater).
func (s *RedisStore) hold(ctx context.Context, key string, cost int64, plans []Plan, h *hold) (Result, error) {
	if s.err != nil {
		return Result{}, s.err
	}
	h.id = newHoldID()
	r, err := s.holdAs(ctx, key, cost, plans, h)
	switch {
	case err == nil:
		h.granted(s, 0)
	case mayHaveRun(err):
		s.giveBackLater(ctx, settleOp{key: key, plans: plans, hold: h, n: cost})
	}
	return r, err
}

// newHoldID returns a new random name for a hold in Redis.
func newHoldID() string {
	return strconv.FormatUint(rand.Uint64(), 36)
}

// holdAs runs the script for the hold h, named h.id, of cost tokens of key
// on plans, and notes in h when it ran, on Redis's clock.
func (s *RedisStore) holdAs(ctx context.Context, key string, cost int64, plans []Plan, h *hold) (Result, error) {
	c := newScriptCall()
	c.Keys = s.appendKeys(c.keys[:0], key, plans, "~"+h.id)
	c.Args = append(s.appendArgs(c.args[:0], cost, plans), h.ttl.Milliseconds())
	r, at, err := s.runAt(ctx, c, cost, plans)
	if err == nil {
		h.at = at
	}
	return r, err
}

// keys returns the Redis keys of plans for key, and then of extra, which
// is not a plan's name.
func (s *RedisStore) keys(key string, plans []Plan, extra ...string) []string {
	return s.appendKeys(make([]string, 0, len(plans)+len(extra)), key, plans, extra...)
}

// appendKeys appends the Redis keys of plans for key, and then of extra,
// to dst.
func (s *RedisStore) appendKeys(dst []string, key string, plans []Plan, extra ...string) []string {
	for i := range plans {
		dst = append(dst, s.Key(key, plans[i].Name))
	}
	for _, x := range extra {
		dst = append(dst, s.Key(key, x))
	}
	return dst
}

// settle runs scripts/settle.lua for the hold of o: o.n tokens on o.plans
// for o.key, of which o.used were used. A hold taken before the key's
// latest Reset (its reset mark) is refunded nothing.
func (s *RedisStore) settle(ctx context.Context, o settleOp) (Settlement, settleStatus, error) {
	key, plans, h, n, actual := o.key, o.plans, o.hold, o.n, o.used
	args := make([]any, 5, 5+3*len(plans))
	args[0], args[1], args[2], args[3], args[4] = n, actual, h.ttl.Milliseconds(), h.skip, h.at
	for i := range plans {
		args = append(args, plans[i].Capacity, formatRate(plans[i].Rate), versionArg(&plans[i]))
	}
	reply, err := s.settleScript.Run(ctx, s.client, s.keys(key, plans, "~"+h.id, resetMarkName), args...)
	if err != nil {
		return Settlement{}, 0, err
	}
	buckets := make([]TokenBucket, len(plans))
	now, lost, status, err := parseSettleReply(buckets, reply)
	if err != nil {
		return Settlement{}, 0, err
	}
	return settlement(o, buckets, now, lost, status), status, nil
}

// parseSettleReply checks the shape of scripts/settle.lua's reply and puts
// bucket i, as stored, in buckets[i].
func parseSettleReply(buckets []TokenBucket, reply any) (now, lost int64, status settleStatus, err error) {
	vals, err := redisscript.Ints(nil, reply, 3+2*len(buckets))
	if err != nil {
		return 0, 0, 0, err
	}
	if vals[0] < 0 || vals[0] > int64(holdReset) {
		return 0, 0, 0, fmt.Errorf("%w: settle status is %d", redisscript.ErrBadReply, vals[0])
	}
	for i := range buckets {
		buckets[i] = TokenBucket{Tokens: vals[2+2*i], Stamp: vals[3+2*i]}
	}
	return vals[1], vals[len(vals)-1], settleStatus(vals[0]), nil
}
