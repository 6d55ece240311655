package tollgate

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestResetMarksAreExactByKey: a Reset voids the refunds of reservations
// of its own key taken before it, and of no other key's, however many
// other keys are reset.
func TestResetMarksAreExactByKey(t *testing.T) {
	var m resetMarks
	now := time.Unix(1000, 0)
	before := m.taken()
	for i := range 10_000 {
		m.reset("other-"+strconv.Itoa(i), now, time.Minute)
	}
	assert.False(t, m.since("k", before), "k was not reset")
	m.reset("k", now, time.Minute)
	assert.True(t, m.since("k", before), "k was reset after the reservation")
	assert.False(t, m.since("k", m.taken()), "a reservation taken after the Reset")
}

// TestResetMarksStayBounded: once maxResetMarks keys were reset, Resets
// older than the hold TTL are forgotten, and so is everything if too many
// are recent, voiding the refunds of every reservation taken before.
func TestResetMarksStayBounded(t *testing.T) {
	var m resetMarks
	t0 := time.Unix(1000, 0)
	m.reset("k", t0, time.Minute)
	mark := m.taken()
	for i := range maxResetMarks - 1 {
		m.reset("old-"+strconv.Itoa(i), t0, time.Minute)
	}
	m.reset("new", t0.Add(2*time.Minute), time.Minute)
	assert.Len(t, m.book.marks, 1, "the Resets older than the hold TTL are forgotten")
	assert.False(t, m.since("k", mark), "forgotten with its hold TTL: no hold taken before it is left")

	recent := m.taken()
	for i := range maxResetMarks {
		m.reset("recent-"+strconv.Itoa(i), t0.Add(2*time.Minute), time.Minute)
	}
	assert.LessOrEqual(t, len(m.book.marks), maxResetMarks/2+1)
	assert.True(t, m.since("k", recent), "a forgotten Reset may have been k's: no refund")
	assert.False(t, m.since("k", m.taken()), "a reservation taken since keeps its refund")
}
