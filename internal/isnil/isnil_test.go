package isnil

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

type client struct{}

func (*client) Run() {}

type runner interface{ Run() }

func TestValue(t *testing.T) {
	var c *client
	var r runner = c
	var f func()
	var m map[string]int
	var ch chan int
	assert.True(t, Value(nil))
	assert.True(t, Value(r), "a typed nil pointer in an interface")
	assert.True(t, Value(f))
	assert.True(t, Value(m))
	assert.True(t, Value(ch))

	assert.False(t, Value(&client{}))
	assert.False(t, Value(0))
	assert.False(t, Value(struct{}{}))
	assert.False(t, Value(func() {}))
}
