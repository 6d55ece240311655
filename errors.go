package tollgate

import (
	"errors"

	"github.com/tollgate-go/tollgate/breaker"
)

// Errors returned by tollgate. They are wrapped with detail, so match them
// with errors.Is. No error text ever contains a caller's key: keys may be
// personal data.
var (
	// ErrInvalidKey means a key is empty or longer than MaxKeyLen bytes.
	ErrInvalidKey = errors.New("tollgate: invalid key")

	// ErrUnknownPlan means a plan name was not given to New.
	ErrUnknownPlan = errors.New("tollgate: unknown plan")

	// ErrInvalidPlan means a Plan breaks the rules documented on Plan, or a
	// plan name appears twice.
	ErrInvalidPlan = errors.New("tollgate: invalid plan")

	// ErrInvalidCost means a cost is below 1 (0 for a Store read), or above
	// the capacity of one of the plans it is charged to, so that it could
	// never be allowed. A Limiter lets a cost above a shadowed plan's
	// capacity through: that plan would deny it (PlanResult.WouldDeny).
	ErrInvalidCost = errors.New("tollgate: invalid cost")

	// ErrInvalidOption means an option given to a constructor is unusable,
	// such as a Redis key prefix that contains a brace.
	ErrInvalidOption = errors.New("tollgate: invalid option")

	// ErrStoreUnavailable means the store could not decide: it failed, or
	// the circuit breaker is open. Limiter returns it only under
	// FailClosed; the other policies decide without the store.
	// It is breaker.ErrStoreUnavailable, which a shared circuit breaker
	// returns under FailClosed too.
	ErrStoreUnavailable = breaker.ErrStoreUnavailable

	// ErrNotHeld means Settle or Cancel changed nothing, because the
	// reservation holds no tokens: it was not granted (Reservation.OK
	// reports false), or it was settled before. A retry of a Settle that
	// failed with an error gets it when the first did reach the store.
	// Permit.Release returns it for a Permit not granted (Permit.OK
	// reports false), or released before.
	ErrNotHeld = errors.New("tollgate: reservation holds nothing to settle")

	// ErrHoldExpired means a reservation's hold was gone when it was
	// settled: it outlived its time to live (WithHoldTTL), Redis lost it,
	// or it held data tollgate did not write, which is replaced. Nothing
	// was refunded; tokens used beyond the reservation were still charged.
	ErrHoldExpired = errors.New("tollgate: reservation hold expired")

	// ErrPermitLost means a Permit's lease ended before its Limiter
	// renewed it or it was released: its holder stopped, or could not
	// reach the store, for longer than the lease (WithPermitLease), so
	// that its permits may have gone to others. Release returns it, and
	// changes nothing.
	ErrPermitLost = errors.New("tollgate: permit lost: its lease ended")

	// ErrWaitExceedsDeadline means Wait would have to wait past the
	// context's deadline, so it returned at once.
	ErrWaitExceedsDeadline = errors.New("tollgate: wait would exceed context deadline")
)

// isCallerError reports whether err is the caller's fault (bad input or
// bad configuration) rather than a store failure. Such errors reach the
// caller under every failure policy and never trip the breaker.
func isCallerError(err error) bool {
	return errors.Is(err, ErrInvalidKey) ||
		errors.Is(err, ErrUnknownPlan) ||
		errors.Is(err, ErrInvalidPlan) ||
		errors.Is(err, ErrInvalidCost) ||
		errors.Is(err, ErrInvalidOption)
}
