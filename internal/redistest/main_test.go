package redistest

import (
	"os"
	"testing"
)

// TestMain runs the tests, then says in one line how many skipped for want
// of redis-server.
func TestMain(m *testing.M) { os.Exit(Main(m)) }
