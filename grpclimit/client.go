package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/callerkey"
	"github.com/tollgate-go/tollgate/internal/isnil"
)

// ClientOption configures the client interceptors.
type ClientOption func(*client)

// WithClientPlans names the plans each outbound call takes its tokens
// from, as WithPlans does on a server. The default, or no names, is the
// Waiter's default plan, which must not be a concurrency plan.
func WithClientPlans(names ...string) ClientOption {
	names = slices.Clone(names)
	return func(c *client) { c.plans = names }
}

// WithClientCost sets the tokens an outbound call takes to
// cost(ctx, method, req), at least 1 and at most the Capacity of each
// plan; req is nil when a stream opens. The default, or a nil cost, takes
// 1 token per call.
func WithClientCost(cost func(ctx context.Context, method string, req any) int64) ClientOption {
	return func(c *client) { c.cost = cost }
}

type client struct {
	w     Waiter
	key   KeyFunc
	plans []string
	cost  func(context.Context, string, any) int64
}

func newClient(caller string, w Waiter, key KeyFunc, opts []ClientOption) *client {
	if isnil.Value(w) || key == nil {
		panic("grpclimit: " + caller + ": nil Waiter or KeyFunc")
	}
	c := &client{w: w, key: key}
	for _, o := range opts {
		o(c)
	}
	p, _ := w.(Planner)
	for i, name := range c.plans {
		if slices.Contains(c.plans[:i], name) {
			panic(fmt.Sprintf("grpclimit: %s: plan %q named twice", caller, name))
		}
		if p != nil {
			plan, ok := p.Plan(name)
			if !ok {
				panic(fmt.Sprintf("grpclimit: %s: unknown plan %q", caller, name))
			}
			if plan.Concurrency {
				panic(fmt.Sprintf("grpclimit: %s: plan %q is a concurrency plan, whose permits a client interceptor cannot hold", caller, name))
			}
		}
	}
	if name, ok := defaultPermits(w, c.plans); ok {
		panic(fmt.Sprintf("grpclimit: %s: the default plan %q is a concurrency plan, whose permits a client interceptor cannot hold: name its plans in WithClientPlans", caller, name))
	}
	return c
}

// UnaryClientInterceptor returns a client interceptor that paces outbound
// unary calls: each waits, with w.Wait, for a token (see WithClientCost)
// from the buckets of the plans (see WithClientPlans) for the key that key
// returns, usually Key("upstream:NAME"), and is then sent.
//
//	grpc.NewClient(target, grpc.WithChainUnaryInterceptor(grpclimit.UnaryClientInterceptor(lim, grpclimit.Key("upstream:billing"))))
//
// The wait honours the call's context: a call whose deadline would pass
// before its tokens are there fails at once, without waiting and without
// being sent, with codes.ResourceExhausted and the details of
// DeniedStatus, and "(client)" in its message, so a caller can tell its
// own limit from a server's. A call whose context ends while it waits
// fails with the context's code; a call the Waiter cannot decide fails as
// ErrorStatus says. The tokens of a call that fails after it was sent are
// spent.
//
// It panics if w (also a typed nil) or key is nil, if a plan is named twice, or if w
// describes its plans and one of the plans is not among them or is a
// concurrency plan (tollgate.Plan.Concurrency), whose permits a call that
// only waits for tokens cannot hold; so is w's default plan, without
// WithClientPlans.
func UnaryClientInterceptor(w Waiter, key KeyFunc, opts ...ClientOption) grpc.UnaryClientInterceptor {
	c := newClient("UnaryClientInterceptor", w, key, opts)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if err := c.wait(ctx, method, req); err != nil {
			return err
		}
		return invoker(ctx, method, req, reply, cc, callOpts...)
	}
}

// StreamClientInterceptor returns a client interceptor that paces the
// opening of outbound streams, as UnaryClientInterceptor paces unary
// calls. The messages of an open stream are not paced.
func StreamClientInterceptor(w Waiter, key KeyFunc, opts ...ClientOption) grpc.StreamClientInterceptor {
	c := newClient("StreamClientInterceptor", w, key, opts)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, callOpts ...grpc.CallOption) (grpc.ClientStream, error) {
		if err := c.wait(ctx, method, nil); err != nil {
			return nil, err
		}
		return streamer(ctx, desc, cc, method, callOpts...)
	}
}

func (c *client) wait(ctx context.Context, method string, req any) error {
	key, err := c.key(ctx, method)
	if err != nil {
		return ErrorStatus(ctx, err).Err()
	}
	cost := int64(1)
	if c.cost != nil {
		cost = c.cost(ctx, method, req)
	}
	res, err := c.w.Wait(callerkey.Context(ctx, key), key, cost, c.plans...)
	switch {
	case errors.Is(err, tollgate.ErrWaitExceedsDeadline):
		p, _ := c.w.(Planner)
		st := DeniedStatus(res, p)
		sp := st.Proto()
		sp.Message = "rate limited (client, plan " + res.Plan + "): the wait would pass the call's deadline"
		return status.FromProto(sp).Err()
	case err != nil:
		return ErrorStatus(ctx, err).Err()
	case !res.Allowed: // a Waiter that gave up without saying why
		return status.Error(codes.ResourceExhausted, "rate limited (client, plan "+res.Plan+")")
	}
	return nil
}
