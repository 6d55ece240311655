package redistest

import (
	"fmt"
	"os"
	"path/filepath"
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

func TestAppends(t *testing.T) {
	if _, err := os.Stat("/proc/self/fdinfo"); err != nil {
		t.Skip("no /proc here: the skip line goes to stdout, shown with -v")
	}
	path := filepath.Join(t.TempDir(), "log")
	for _, tc := range []struct {
		flag int
		want bool
	}{
		{os.O_WRONLY | os.O_CREATE | os.O_TRUNC, false}, // go test > log
		{os.O_WRONLY | os.O_CREATE | os.O_APPEND, true}, // go test >> log
	} {
		f, err := os.OpenFile(path, tc.flag, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if got := appends(fmt.Sprintf("/proc/self/fdinfo/%d", f.Fd())); got != tc.want {
			t.Errorf("appends(file opened with %#o) = %v, want %v", tc.flag, got, tc.want)
		}
		_ = f.Close()
	}
}
