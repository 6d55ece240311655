package tollgate

import "sync/atomic"

// resetMarks counts a Limiter's Resets by key, so that a settlement can
// tell whether its key was reset since its reservation was taken: a
// refund would give back tokens to a bucket that Reset filled without
// them, and overfill it once tokens were taken after the Reset. Keys
// share resetStripes counters by a hash of the key: a Reset of one key
// also voids the refunds of reservations of the keys that share its
// counter, which under-admits and never over-admits. The zero value is
// ready; it is safe for concurrent use.
type resetMarks struct {
	stripes [resetStripes]atomic.Uint64
}

// resetStripes is how many counters the keys share.
const resetStripes = 64

// of returns the count of key's Resets: a later reading that differs
// follows a Reset of key, or of a key that shares its counter.
func (m *resetMarks) of(key string) uint64 {
	return m.stripe(key).Load()
}

// reset counts a Reset of key.
func (m *resetMarks) reset(key string) {
	m.stripe(key).Add(1)
}

// stripe returns key's counter, chosen by key's 64-bit FNV-1a hash.
func (m *resetMarks) stripe(key string) *atomic.Uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(key); i++ {
		h = (h ^ uint64(key[i])) * 1099511628211
	}
	return &m.stripes[h%resetStripes]
}
