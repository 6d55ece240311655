package grpclimit

import (
	"context"
	"errors"

	"google.golang.org/grpc"

	"github.com/tollgate-go/tollgate"
)

// limitedStream limits the messages a stream's handler receives.
type limitedStream struct {
	grpc.ServerStream
	s     *server
	key   string
	plans []string
	ctx   context.Context // the stream's, naming the key's caller's key (callerkey)
}

// RecvMsg receives a message, then takes its tokens before the handler
// sees it: pacing holds the message, and with it the stream's reads.
func (ls *limitedStream) RecvMsg(m any) error {
	if err := ls.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	s, ctx := ls.s, ls.ctx
	cost := int64(1)
	if s.msgCost != nil {
		cost = s.msgCost(m)
	}
	var res tollgate.Result
	var err error
	if s.msgMode == Pace {
		res, err = s.waiter.Wait(ctx, ls.key, cost, ls.plans...)
		if errors.Is(err, tollgate.ErrWaitExceedsDeadline) {
			res.Allowed, err = false, nil
		}
	} else {
		res, err = s.lim.AllowN(ctx, ls.key, cost, ls.plans...)
	}
	if err != nil {
		return s.errorStatus(ctx, err)
	}
	if !res.Allowed {
		ls.SetTrailer(s.deniedMetadata(&res))
		return s.deniedStatus(ctx, res)
	}
	return nil
}
