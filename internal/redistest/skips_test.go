package redistest

import (
	"strings"
	"testing"
)

func TestSkipLine(t *testing.T) {
	for _, tc := range []struct {
		n    int
		want string
	}{
		{1, "tollgate/breaker: 1 test skipped: redis-server not found; "},
		{31, "tollgate/breaker: 31 tests skipped: redis-server not found; "},
	} {
		line := SkipLine("tollgate/breaker", tc.n)
		if !strings.HasPrefix(line, tc.want) {
			t.Errorf("SkipLine(%d) = %q, want it to begin %q", tc.n, line, tc.want)
		}
		// The line says how to run them, and is one line.
		if !strings.Contains(line, "apt-get install redis-server") || !strings.Contains(line, "go test -count=1 ./...") || strings.Contains(line, "\n") {
			t.Errorf("SkipLine(%d) = %q, want one line naming the install and the command", tc.n, line)
		}
	}
}
