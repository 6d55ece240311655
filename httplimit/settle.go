package httplimit

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"

	"github.com/tollgate-go/tollgate"
)

// Reserver is a RateLimiter that reserves a cost and settles it later, as
// *tollgate.Limiter does: WithSettle needs one.
type Reserver interface {
	Reserve(ctx context.Context, key string, n int64, plans ...string) (*tollgate.Reservation, error)
}

// Response is what a handler answered, as WithSettle's cost function sees
// it.
type Response struct {
	// Status is the status code sent, for example 200.
	Status int
	// Bytes is the number of body bytes written, for example 5120.
	Bytes int64
}

// WithSettle charges each request what it turned out to cost, once the
// handler has returned. The request first reserves its cost (1, or what
// WithCost says: make that the most a request may cost) with Reserve, and
// a request that gets the reservation is settled with final's answer, for
// example the kilobytes it sent: the unused rest is refunded, and a cost
// beyond it charged as debt (see tollgate.Reservation.Settle). The
// settlement ignores the request's cancellation, since the response is
// sent; if it fails, the reservation stays charged in full, which errs on
// the safe side. A handler that panics is settled too, with status 500
// if it set none, and the panic goes on up. A cost beyond what Settle
// takes (tollgate.ErrInvalidCost) is charged as the most it takes. The
// handler's writer counts what it writes and passes Flush and Hijack (http.Flusher,
// http.Hijacker) on to the server's; Hijack fails where the server's
// cannot, as on HTTP/2.
//
// Middleware panics if its RateLimiter is not a Reserver, or if a plan
// the requests take from is a sliding window (tollgate.Plan.Window) or a
// concurrency plan, which take no reservation.
func WithSettle(final func(r *http.Request, resp Response) int64) Option {
	return func(m *middleware) { m.final = final }
}

// checkSettle panics if WithSettle is given and a plan the requests take
// from, the default plan without WithPlans, is a sliding window, which
// Reserve refuses: every request would be answered 500.
func (m *middleware) checkSettle() {
	if m.final == nil {
		return
	}
	for _, plan := range m.described() {
		if plan.Window > 0 {
			panic(fmt.Sprintf("httplimit: Middleware: WithSettle: plan %q is a sliding window, which takes no reservation", plan.Name))
		}
	}
}

// described returns the plans the requests take from, as far as the
// RateLimiter describes them.
func (m *middleware) described() []tollgate.Plan {
	if len(m.plans) == 0 {
		if d, ok := m.lim.(defaulter); ok {
			return []tollgate.Plan{d.DefaultPlan()}
		}
		return nil
	}
	if m.planner == nil {
		return nil
	}
	var plans []tollgate.Plan
	for _, name := range m.plans {
		if plan, ok := m.planner.Plan(name); ok {
			plans = append(plans, plan)
		}
	}
	return plans
}

// serveHeld calls next for a request that got reservation res, and
// settles it with what m.final makes of the response, under ctx, the
// reservation's: a plan resolver sees the key it saw then. A deferred
// settlement also settles a handler that panics, and the panic goes on up
// unrecovered, with its stack.
func (m *middleware) serveHeld(ctx context.Context, w http.ResponseWriter, r *http.Request, res *tollgate.Reservation, next http.Handler) {
	cw := &countingWriter{ResponseWriter: w}
	returned := false
	defer func() { m.settle(ctx, r, res, cw, returned) }()
	next.ServeHTTP(cw, r)
	returned = true
}

// maxSettle is the most tokens tollgate.Reservation.Settle takes, 2^53
// micro-tokens; it answers tollgate.ErrInvalidCost beyond. Debt is capped
// at a capacity below it, so a cost beyond charges no more.
const maxSettle = (1 << 53) / 1_000_000

// settle settles res with what m.final makes of the response cw noted:
// 200 if nothing set a status and the handler returned, 500 if it
// panicked first, and the cost within what Settle takes.
func (m *middleware) settle(ctx context.Context, r *http.Request, res *tollgate.Reservation, cw *countingWriter, returned bool) {
	switch {
	case cw.status != 0:
	case returned:
		cw.status = http.StatusOK
	default:
		cw.status = http.StatusInternalServerError
	}
	used := min(max(0, m.final(r, Response{Status: cw.status, Bytes: cw.bytes})), maxSettle)
	_, _ = res.Settle(context.WithoutCancel(ctx), used)
}

// countingWriter notes the status and counts the body bytes of a
// response. Flush and Hijack pass through to the writer beneath, which
// handlers find by asserting http.Flusher and http.Hijacker; Unwrap lets
// http.ResponseController reach its other methods.
type countingWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

// WriteHeader notes the first final status: an informational one (1xx,
// such as 103 Early Hints, but not 101 Switching Protocols) comes before
// it, as net/http sends it.
func (w *countingWriter) WriteHeader(code int) {
	if w.status == 0 && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

func (w *countingWriter) Unwrap() http.ResponseWriter {
	return w.ResponseWriter
}

// Flush sends what was written so far, if the writer beneath can.
func (w *countingWriter) Flush() {
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack lets the handler take over the connection, if the writer beneath
// can (HTTP/1); otherwise it returns an error wrapping
// http.ErrNotSupported. The request is then settled with what was
// written before, and status 200 if nothing was.
func (w *countingWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}
