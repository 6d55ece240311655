package tollgate

import (
	"errors"
	"time"

	"github.com/redis/go-redis/v9"
)

// callBudgeter is a store that can tell how long one of its calls takes,
// at most, while this process runs and the store answers nothing. The
// Limiter judges a timeout that came far later than that as this
// process's stall, not as the store's failure.
type callBudgeter interface {
	// callBudget returns the longest a call to the store takes while this
	// process runs and the store does not answer; 0 when unknown.
	callBudget() time.Duration
}

// errStalled is the class, in Stats.StoreErrors ("stalled"), of a store
// call that timed out because this process was stalled.
var errStalled = errors.New("process stalled")

// stalled reports whether a store call that began at start and failed
// with err at now (the Limiter's clock) timed out because this process
// was stopped or starved of CPU, not because the store failed to answer:
// the call timed out, and took longer than the store's call budget, which
// no call on a running process outlasts. The timers of calls in flight
// when a process is stopped all fire when it runs again, late by the
// stop, however soon the store answered.
//
// A store asked without an answer since since (see askedSince) for a
// cooldown before this call began is hung, or too slow, however late this
// call learnt of it: the call is the store's failure then. A stall cannot
// make that so, for it began after the call.
func (l *Limiter) stalled(err error, start, now, since int64) bool {
	budget := int64(l.health.budget)
	if budget <= 0 || now-start <= budget || !isTimeout(err) {
		return false
	}
	return start-since < int64(l.health.settings.Cooldown)
}

// isTimeout reports whether err is a timeout: a network wait's, a
// context deadline's, or a wait for a client's connection.
func isTimeout(err error) bool {
	return errorClass(err) == "timeout" || errors.Is(err, redis.ErrPoolTimeout)
}
