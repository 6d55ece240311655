package tollgate

import (
	"os"
	"testing"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestMain runs the tests, then says in one line how many skipped for want
// of redis-server.
func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }
