package grpclimit

import (
	"context"
	"errors"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/ratefields"
)

// Planner describes plans by name. *tollgate.Limiter implements it.
type Planner interface {
	Plan(name string) (tollgate.Plan, bool)
}

// ErrorInfo's Reason and Domain for a denial.
const (
	// ReasonRateLimited is the Reason of a denial's errdetails.ErrorInfo.
	ReasonRateLimited = "RATE_LIMITED"
	// Domain is the Domain of a denial's errdetails.ErrorInfo.
	Domain = "tollgate"
)

// DeniedStatus returns the status that ends a denied call by default:
// codes.ResourceExhausted, the message "rate limited (plan NAME)", and
// these details, which name the plans and never the key:
//
//   - errdetails.RetryInfo: RetryDelay is res.RetryAfter rounded up to the
//     millisecond, and at least 1ms, so a client that waits that long
//     finds the tokens, and none is told to come back at once;
//   - errdetails.QuotaFailure: one violation per plan that lacks the
//     tokens, Subject "plan:NAME" and Description such as
//     "20 tokens, refilled at 2 per second" for a token bucket or
//     "100 tokens in any 1m0s" for a sliding window;
//   - errdetails.ErrorInfo: Reason "RATE_LIMITED", Domain "tollgate",
//     Metadata {"plan": NAME} for the plan that makes the caller wait
//     longest.
//
// When the binding plan is a concurrency plan (tollgate.Plan.Concurrency),
// as p describes it, the message is "no free permit (plan NAME)", a
// violation's Description such as "10 permits held at once", and there is
// no RetryInfo: a permit comes back when a call ends, on no schedule, and
// a client retries after its own backoff.
//
// p describes the plans' rates for the descriptions; it may be nil.
func DeniedStatus(res tollgate.Result, p Planner) *status.Status {
	concurrent := ratefields.Concurrent(&res, p)
	msg := "rate limited (plan " + res.Plan + ")"
	if concurrent {
		msg = "no free permit (plan " + res.Plan + ")"
	}
	st := status.New(codes.ResourceExhausted, msg)
	qf := &errdetails.QuotaFailure{}
	for _, pr := range res.PlanResults() {
		if pr.RetryAfter > 0 || pr.Plan == res.Plan {
			qf.Violations = append(qf.Violations, &errdetails.QuotaFailure_Violation{
				Subject:     "plan:" + pr.Plan,
				Description: describePlan(pr, p),
			})
		}
	}
	details := []protoadapt.MessageV1{
		qf,
		&errdetails.ErrorInfo{Reason: ReasonRateLimited, Domain: Domain, Metadata: map[string]string{"plan": res.Plan}},
	}
	if !concurrent {
		details = append([]protoadapt.MessageV1{&errdetails.RetryInfo{RetryDelay: durationpb.New(retryDelay(res.RetryAfter))}}, details...)
	}
	withDetails, err := st.WithDetails(details...)
	if err != nil { // cannot happen: the details are well-formed messages
		return st
	}
	return withDetails
}

// describePlan returns a QuotaFailure violation's Description.
func describePlan(pr tollgate.PlanResult, p Planner) string {
	d := strconv.FormatInt(pr.Limit, 10) + " tokens"
	if p != nil {
		switch plan, ok := p.Plan(pr.Plan); {
		case !ok:
		case plan.Concurrency:
			d = strconv.FormatInt(pr.Limit, 10) + " permits held at once"
		case plan.Window > 0:
			d += " in any " + plan.Window.String()
		default:
			d += ", refilled at " + strconv.FormatFloat(plan.Rate, 'g', 6, 64) + " per second"
		}
	}
	return d
}

// retryDelay returns d rounded up to the millisecond, and at least 1ms.
func retryDelay(d time.Duration) time.Duration {
	ms := (max(d, 0) + time.Millisecond - 1) / time.Millisecond
	return max(ms, 1) * time.Millisecond
}

// ErrorStatus returns the status that ends a call the RateLimiter could
// not decide by default. ctx is the call's context and err the error of
// its KeyFunc or RateLimiter.
//
//   - The call's context ended (cancelled, or past its deadline): the
//     context's own code, Canceled or DeadlineExceeded, as
//     status.FromContextError gives it.
//   - No usable key (ErrNoKey, tollgate.ErrInvalidKey for a key that is
//     empty or longer than tollgate.MaxKeyLen bytes): InvalidArgument.
//   - tollgate.ErrStoreUnavailable, which a Limiter returns under
//     FailClosed only: Unavailable, which gRPC retry policies commonly
//     retry, with the message "rate limiter unavailable", also when it
//     wraps a context error of the store's own deadline while the call's
//     context is live. The other policies decide without the store, so
//     this never happens.
//   - Anything else, such as tollgate.ErrInvalidCost from a WithCost
//     function or tollgate.ErrUnknownPlan: Internal, "rate limiter error".
//
// The messages are fixed text: never err's, which may hold what a KeyFunc
// of your own put there.
func ErrorStatus(ctx context.Context, err error) *status.Status {
	switch {
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err())
	case errors.Is(err, tollgate.ErrStoreUnavailable):
		// Before the context errors it may wrap: a store bounded by a
		// deadline of its own failed, not the caller's call.
		return statusUnavailable
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err)
	case errors.Is(err, ErrNoKey):
		return statusNoKey
	case errors.Is(err, tollgate.ErrInvalidKey):
		return statusBadKey
	}
	return statusInternal
}

// The statuses of ErrorStatus. A Status is immutable once made, so they
// are shared.
var (
	statusNoKey       = status.New(codes.InvalidArgument, "no rate limit key in call")
	statusBadKey      = status.New(codes.InvalidArgument, "rate limit key empty or too long")
	statusUnavailable = status.New(codes.Unavailable, "rate limiter unavailable")
	statusInternal    = status.New(codes.Internal, "rate limiter error")
)
