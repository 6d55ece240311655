package tollgate

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestResetMarksCountByKey: a Reset changes its key's mark, and leaves
// the mark of a key of another counter as it was.
func TestResetMarksCountByKey(t *testing.T) {
	var m resetMarks
	k, other := m.of("k"), m.of("other")
	m.reset("k")
	assert.NotEqual(t, k, m.of("k"))
	assert.Equal(t, other, m.of("other"), "\"other\" has a counter of its own")
}
