package redistest

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
)

// This file tells a newcomer, in one line that go test shows without -v,
// how many tests did not run for want of redis-server.

// skippedNoServer counts the tests of this test binary that
// SkipIfUnavailable skipped because redis-server is not on PATH.
var skippedNoServer atomic.Int64

// shortReason is why a test that needs a real Redis skips under -short.
const shortReason = "redistest: -short runs no real Redis; run go test without -short to include this test"

// SkipIfShort skips t under -short: real Redis servers, clusters and the
// tests that time them are what make the suite slow. Tests that reach a
// real Redis without this package's other functions call it first.
func SkipIfShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip(shortReason)
	}
}

// Main runs m's tests and returns the code to pass to os.Exit. A package
// whose tests use this package calls it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }
//
// If tests skipped because redis-server is not on PATH, it then writes one
// line naming how many and how to run them (see SkipLine).
func Main(m *testing.M) int {
	code := m.Run()
	if n := skippedNoServer.Load(); n > 0 {
		report(SkipLine(callerPackage(), int(n)))
	}
	return code
}

// SkipLine returns the line Main writes when n tests of pkg skipped for
// want of redis-server.
func SkipLine(pkg string, n int) string {
	tests := "tests"
	if n == 1 {
		tests = "test"
	}
	return fmt.Sprintf("%s: %d %s skipped: redis-server not found; install it (apt-get install redis-server) and run go test -count=1 ./...",
		pkg, n, tests)
}

// callerPackage returns the import path of the package whose TestMain
// called Main, without the module's host and owner: "tollgate/breaker".
func callerPackage() string {
	pc, _, _, ok := runtime.Caller(2)
	fn := runtime.FuncForPC(pc)
	if !ok || fn == nil {
		return "tollgate"
	}
	name := fn.Name() // "github.com/tollgate-go/tollgate/breaker_test.TestMain"
	slash := strings.LastIndex(name, "/")
	if dot := strings.Index(name[slash+1:], "."); dot >= 0 {
		name = name[:slash+1+dot]
	}
	name = strings.TrimSuffix(name, "_test")
	if i := strings.Index(name, "tollgate-go/"); i >= 0 {
		name = name[i+len("tollgate-go/"):]
	}
	return name
}

// report writes line where go test shows it. go test ./... shows a passing
// package's output only with -v (or -json), so without -v the line goes to
// the go command's own standard output, the terminal or pipe the user
// reads; elsewhere (-v, -json, a test binary run by hand, or no /proc) it
// goes to standard output.
func report(line string) {
	if !testing.Verbose() {
		if w := goCommandStdout(); w != nil {
			defer w.Close()
			if _, err := io.WriteString(w, line+"\n"); err == nil {
				return
			}
		}
	}
	fmt.Println(line)
}

// goCommandStdout opens the standard output of the go command that runs
// this test binary, on Linux, when it is a terminal, a pipe, or a file the
// go command appends to (>>). A file written at the go command's own
// offset (>) is left alone: the go command's next write would overwrite
// the line. It returns nil otherwise.
func goCommandStdout() io.WriteCloser {
	proc := "/proc/" + strconv.Itoa(os.Getppid())
	comm, err := os.ReadFile(proc + "/comm")
	if err != nil || strings.TrimSpace(string(comm)) != "go" {
		return nil
	}
	path := proc + "/fd/1"
	info, err := os.Stat(path)
	if err != nil {
		return nil
	}
	if info.Mode()&(fs.ModeCharDevice|fs.ModeNamedPipe) == 0 && !(info.Mode().IsRegular() && appends(proc+"/fdinfo/1")) {
		return nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return nil
	}
	return f
}

// appends reports whether the open file that fdinfo (a /proc/PID/fdinfo/N
// file) describes was opened with O_APPEND.
func appends(fdinfo string) bool {
	b, err := os.ReadFile(fdinfo)
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "flags:"); ok {
			flags, err := strconv.ParseUint(strings.TrimSpace(v), 8, 64)
			return err == nil && flags&uint64(os.O_APPEND) != 0
		}
	}
	return false
}
