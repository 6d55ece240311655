package tollgate

import (
	"context"
	"fmt"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// acquire decides o, an Acquire, in one call of the limit script: its
// concurrency plans take its holder's permits, the others its tokens. A
// call that fails but may have run in Redis all the same, or may yet, is
// released by the holder's id (releaseLater).
func (s *RedisStore) acquire(ctx context.Context, o op) (Result, error) {
	if s.err != nil {
		return Result{}, s.err
	}
	c := newScriptCall()
	c.Keys = s.appendKeys(c.keys[:0], o.key, o.plans)
	c.Args = s.appendPermitArgs(c.args[:0], &o)
	r, now, err := s.runAt(ctx, c, o.n, o.plans)
	sent, err := leftOf(err)
	o.grant.decidedAt = now
	switch {
	case err == nil && r.Allowed:
		o.grant.store = s
	case err != nil && mayHaveRun(err):
		s.releaseLater(ctx, o, sent)
	}
	return r, err
}

// appendPermitArgs appends the limit script's ARGV for the Acquire o to
// dst, in the wide layout: a concurrency plan's numbers are its capacity,
// the lease in µs, -1, and the holder's id.
func (s *RedisStore) appendPermitArgs(dst []any, o *op) []any {
	dst = append(dst, o.n, s.draw(o.plans))
	for i := range o.plans {
		if p := &o.plans[i]; p.Concurrency {
			dst = append(dst, p.Capacity, o.grant.lease.Microseconds(), -1, o.grant.id)
		} else {
			dst = s.planArgs.appendTo(dst, p, 4)
		}
	}
	return dst
}

// releaseLater releases the permits of o, an Acquire whose call failed
// but may have run, by the holder's id: on a goroutine that the Limiter's
// Close waits for, tried until it succeeds or holdBackTimeout passes
// (retryGiveBack). An acquire whose caller gave up while its batch was on
// its way is released once sent receives, when the batch's reply is in
// (nil for one that rode no batch). An acquire that reaches Redis after
// its release keeps its permits until their lease ends.
func (s *RedisStore) releaseLater(ctx context.Context, o op, sent <-chan struct{}) {
	release := permitOp{key: o.key, plans: concurrencyOf(o.plans),
		holders: []permitHolder{{id: o.grant.id, n: o.n}}}
	release.holders[0].mask = 1<<len(release.plans) - 1
	backs := o.grant.backs
	backs.add()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holdBackTimeout)
	go func() {
		defer cancel()
		defer backs.done()
		if sent != nil {
			select {
			case <-sent:
			case <-ctx.Done():
				return
			}
		}
		retryGiveBack(ctx, func() error {
			_, err := s.permits(ctx, release)
			return err
		})
	}()
}

// permits implements permitStore with scripts/permit.lua.
func (s *RedisStore) permits(ctx context.Context, o permitOp) (permitReply, error) {
	args := make([]any, 2, 2+3*len(o.holders))
	args[0], args[1] = o.lease.Microseconds(), 0
	if o.adopt {
		args[1] = 1
	}
	for _, h := range o.holders {
		args = append(args, h.id, h.n, h.mask)
	}
	reply, err := s.permitScript.Run(ctx, s.client, s.keys(o.key, o.plans), args...)
	if err != nil {
		return permitReply{}, err
	}
	vals, err := redisscript.Ints(nil, reply, 2+len(o.holders))
	if err != nil {
		return permitReply{}, err
	}
	if vals[1] < 0 {
		return permitReply{}, fmt.Errorf("%w: %d permits reclaimed", redisscript.ErrBadReply, vals[1])
	}
	live := make([]bool, len(o.holders))
	for h, v := range vals[2:] {
		if v != 0 && v != 1 {
			return permitReply{}, fmt.Errorf("%w: a permit's status is %d", redisscript.ErrBadReply, v)
		}
		live[h] = v == 1
	}
	return permitReply{now: vals[0], live: live, reclaimed: vals[1]}, nil
}
