package tollgate

import (
	"context"
	"errors"
	"fmt"

	"github.com/tollgate-go/tollgate/internal/bucketvalue"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// lean reports whether a take or a read on plans can run the lean
// decision (scripts/take.lua) instead of the general one: one token
// bucket plan, without a version, not shadowed. A hold never does.
func lean(plans []Plan) bool {
	if len(plans) != 1 {
		return false
	}
	p := &plans[0]
	return !p.isWindow() && !p.Concurrency && p.Version == 0 && !p.Shadow
}

// decisionScripts are what a RedisStore runs in Redis for a decision: the
// general script, alone and batched, and the lean decision's functions,
// alone and batched. It is safe for concurrent use.
type decisionScripts struct {
	limit     *redisscript.Script
	limitMany *redisscript.Batch
	take      *redisscript.Function
	takeMany  *redisscript.Grouped
}

// newDecisionScripts returns the scripts and functions of a store, with a
// library of its own, so that each store learns on its first lean
// decision whether its Redis has functions.
func newDecisionScripts() *decisionScripts { return decisionScriptsOn(luaBucket) }

// decisionScriptsOn returns the scripts and functions of a store, with
// bucket as the bucket's functions (scripts/bucket.lua, which tests may
// give a clock of their own).
func decisionScriptsOn(bucket string) *decisionScripts {
	fns := redisscript.NewLibrary("tollgate", redisscript.ReplyLua+bucket+luaTake,
		redisscript.Entry{Name: "take", Body: "return takeOne(KEYS, ARGV)"},
		redisscript.Entry{Name: "take_many", Body: "return takeMany(KEYS, ARGV)"})
	return &decisionScripts{
		limit:     redisscript.New(bucket + luaSemaphore + luaLimit),
		limitMany: redisscript.NewBatch(bucket+luaSemaphore, luaLimit),
		take:      fns[0],
		takeMany:  redisscript.NewGrouped(fns[1], 1), // the cost is each call's own; capacity and rate are its plan's
	}
}

// runOne runs the decision c alone on client, the lean function if c is
// lean, and returns its reply.
func (d *decisionScripts) runOne(ctx context.Context, client redisscript.Client, c *scriptCall) (any, error) {
	if c.lean {
		return d.take.Run(ctx, client, c.Keys, c.Args...)
	}
	return d.limit.Run(ctx, client, c.Keys, c.Args...)
}

// runMany runs the decisions calls on client, in their order, in one
// call, and sets each one's Reply or Err: the lean batch if every one is
// lean, else the general batch, which decides lean ones as well; a
// decision alone as runOne does.
func (d *decisionScripts) runMany(ctx context.Context, client redisscript.Client, calls []*scriptCall) {
	switch {
	case len(calls) == 0:
		return
	case len(calls) == 1:
		calls[0].Reply, calls[0].Err = d.runOne(ctx, client, calls[0])
		return
	}
	all := true
	many := make([]*redisscript.Call, len(calls))
	for i, c := range calls {
		all = all && c.lean
		many[i] = &c.Call
	}
	if all {
		d.takeMany.Run(ctx, client, many)
	} else {
		d.limitMany.Run(ctx, client, many)
	}
	if refusedForKeys(calls) {
		for _, c := range calls {
			c.Reply, c.Err = d.runOne(ctx, client, c)
		}
	}
}

// refusedForKeys reports whether the batch calls was refused as a whole
// for what may be one decision's alone: NOPERM, which Redis answers
// before a script call runs when an ACL forbids one of its keys, so that
// none of it ran. Each decision is then sent alone, so that only those
// with a forbidden key fail. A NOPERM of one decision inside a batch that
// ran is its own error, not the batch's, and sends nothing again.
func refusedForKeys(calls []*scriptCall) bool {
	err := calls[0].Err
	var rerr *redisscript.Error
	if !errors.As(err, &rerr) || rerr.Class != "NOPERM" {
		return false
	}
	for _, c := range calls[1:] {
		if c.Err != err { // the batch's error is one value, given to each
			return false
		}
	}
	return true
}

// loads returns how many times the scripts' and functions' source was
// sent after Redis answered that it lacked them.
func (d *decisionScripts) loads() int64 {
	return d.limit.Loads() + d.limitMany.Loads() + d.take.Loads() + d.takeMany.Loads()
}

// replyInts is redisscript.Ints for a decision's reply, which a lean
// decision in a batch gives as a redisscript.Record (leanInts).
func replyInts(dst []int64, reply any, n int) ([]int64, error) {
	if r, ok := reply.(redisscript.Record); ok && n == 4 {
		return leanInts(dst, r)
	}
	return redisscript.Ints(dst, reply, n)
}

// leanInts appends to dst the four integers of a lean decision's reply
// (allowed, now, tokens and stamp, as scripts/take.lua's takeOne replies
// them) from r, its record in a batch (takeMany): now in 7 bytes shared
// by the batch, then allowed in a byte and a bucket's bytes, which hold
// the tokens and stamp. Anything else is ErrBadReply.
func leanInts(dst []int64, r redisscript.Record) ([]int64, error) {
	dst, err := redisscript.Ints(dst, r.Shared, 1)
	if err != nil {
		return dst, err
	}
	if len(r.Own) == 0 || r.Own[0] > 1 {
		return dst, fmt.Errorf("%w: a lean decision's allowed flag is not 0 or 1", redisscript.ErrBadReply)
	}
	b, ok := bucketvalue.Decode(r.Own[1:])
	if !ok {
		return dst, fmt.Errorf("%w: a lean decision's bucket is not one", redisscript.ErrBadReply)
	}
	now := dst[len(dst)-1]
	return append(dst[:len(dst)-1], int64(r.Own[0]), now, b.Tokens, b.Stamp), nil
}
