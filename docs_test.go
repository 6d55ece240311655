package tollgate_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/alicebob/miniredis/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The Go blocks of the Markdown pages are compiled here, so that none
// drifts from the API. CONTRIBUTING.md states the convention: a block
// that starts with "package main" (after comments) is a whole program
// and must compile as it stands; any other block is a fragment, pasted
// into the body of a function that returns an error, in a file that
// imports snippetImports and declares snippetHelpers. A fragment may
// leave variables and imports unused.

// docPages are the pages whose Go blocks are compiled.
func docPages(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	require.NoError(t, err)
	return append([]string{"README.md", "CONTRIBUTING.md", "RELEASING.md"}, pages...)
}

// snippetImports are the packages a fragment may use, by the name it uses.
var snippetImports = []string{
	`"context"`, `"errors"`, `"fmt"`, `"log"`, `"log/slog"`, `"net"`,
	`"net/http"`, `"net/netip"`, `"os"`, `"time"`,
	`"github.com/redis/go-redis/v9"`,
	`"github.com/tollgate-go/tollgate"`,
	`"github.com/tollgate-go/tollgate/breaker"`,
	`"github.com/tollgate-go/tollgate/httplimit"`,
	`"github.com/tollgate-go/tollgate/grpclimit"`,
	`tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"`,
	`tgotel "github.com/tollgate-go/tollgate/metrics/otel"`,
	`"github.com/prometheus/client_golang/prometheus"`,
	`"github.com/prometheus/client_golang/prometheus/promhttp"`,
	`"go.opentelemetry.io/otel/attribute"`,
	`"go.opentelemetry.io/otel/metric"`,
	`"google.golang.org/grpc"`,
}

// snippetHelpers are the names a fragment may use without declaring them:
// the things a page's text has introduced already.
const snippetHelpers = `
var (
	ctx                    context.Context
	lim, apiLim, loginLim  *tollgate.Limiter
	store                  tollgate.Store
	plans                  []tollgate.Plan
	client                 *redis.Client
	mux                    *http.ServeMux
	apiHandler             http.Handler
	key, apiKey, teamID    string
	dest, target           string
	maxTokens              int64
	mp, meterProvider      metric.MeterProvider
	tiers                  interface{ Of(key string) string }
	callModel              func(ctx context.Context, maxTokens int64) (answer struct{ Usage struct{ Tokens int64 } })
	post                   func(ctx context.Context, dest string) error
	outcomeOf              func(err error) breaker.Outcome
	requeue                func(after time.Duration) error
)
`

// goBlock is one fenced Go block of a page.
type goBlock struct {
	page string
	line int // of the block's first line of code
	code string
}

func (b goBlock) program() bool {
	for _, l := range strings.Split(b.code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "//") {
			continue
		}
		return strings.HasPrefix(l, "package main")
	}
	return false
}

// goBlocks returns the fenced Go blocks of a Markdown page; a fence may be
// indented, as in a list item, and its block loses that indentation.
func goBlocks(t *testing.T, page string) []goBlock {
	t.Helper()
	data, err := os.ReadFile(page)
	require.NoError(t, err)
	var blocks []goBlock
	var cur *goBlock
	var indent string
	for i, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimLeft(line, " \t")
		switch {
		case cur == nil && strings.HasPrefix(trimmed, "```go") && strings.TrimSpace(trimmed[5:]) == "":
			indent = line[:len(line)-len(trimmed)]
			cur = &goBlock{page: page, line: i + 2}
		case cur != nil && strings.HasPrefix(trimmed, "```"):
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			cur.code += strings.TrimPrefix(line, indent) + "\n"
		}
	}
	require.Nil(t, cur, "%s: a Go block is not closed", page)
	return blocks
}

// fragmentFile wraps a fragment into a file of package snippet.
func fragmentFile(b goBlock) string {
	var f strings.Builder
	f.WriteString("package snippet\n\nimport (\n")
	for _, imp := range snippetImports {
		f.WriteString("\t" + imp + "\n")
	}
	f.WriteString(")\n" + snippetHelpers + "\nfunc _() error {\n")
	fmt.Fprintf(&f, "//line %s:%d\n%s\n\treturn nil\n}\n", b.page, b.line, b.code)
	return f.String()
}

// exportData lists, through the go command, the compiled export data of
// the packages the blocks may import and of their dependencies.
func exportData(t *testing.T, programs []goBlock) map[string]string {
	t.Helper()
	args := []string{"list", "-export", "-deps", "-json=ImportPath,Export"}
	for _, imp := range snippetImports {
		_, path, _ := strings.Cut(imp, `"`)
		args = append(args, strings.TrimSuffix(path, `"`))
	}
	for _, b := range programs {
		f, err := parser.ParseFile(token.NewFileSet(), "main.go", b.code, parser.ImportsOnly)
		if err != nil {
			continue // reported when the block is checked
		}
		for _, imp := range f.Imports {
			args = append(args, strings.Trim(imp.Path.Value, `"`))
		}
	}
	cmd := exec.Command("go", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list: %s", stderr.String())
	exports := map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct{ ImportPath, Export string }
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else {
			require.NoError(t, err)
		}
		exports[p.ImportPath] = p.Export
	}
	return exports
}

// typeCheck type-checks one file, returning its errors; soft errors
// (unused variables and imports) count only when strict.
func typeCheck(fset *token.FileSet, imp types.Importer, src string, strict bool) []string {
	// The file's name is in the repository's root, so that the pages'
	// paths in its line directives are read from there.
	file, err := parser.ParseFile(fset, "snippet.go", src, parser.ParseComments)
	if err != nil {
		return []string{err.Error()}
	}
	var errs []string
	conf := types.Config{Importer: imp, Error: func(err error) {
		var te types.Error
		if errors.As(err, &te) && te.Soft && !strict {
			return
		}
		errs = append(errs, err.Error())
	}}
	_, _ = conf.Check("snippet", fset, []*ast.File{file}, nil)
	return errs
}

// TestDocsGoBlocksCompile type-checks every Go block of README.md,
// CONTRIBUTING.md, RELEASING.md and docs/*.md.
func TestDocsGoBlocksCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("compiles the docs' Go blocks through the go command; skipped with -short")
	}
	if gowork := goEnv(t, "GOWORK"); gowork == "" || gowork == "off" {
		t.Skip("the docs' blocks import the adapters' modules, which only go.work joins; run from the repository with its go.work")
	}
	var blocks, programs []goBlock
	for _, page := range docPages(t) {
		blocks = append(blocks, goBlocks(t, page)...)
	}
	for _, b := range blocks {
		if b.program() {
			programs = append(programs, b)
		}
	}
	exports := exportData(t, programs)
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		if exports[path] == "" {
			return nil, fmt.Errorf("no export data for %q", path)
		}
		return os.Open(exports[path])
	})
	for _, b := range blocks {
		src := fmt.Sprintf("//line %s:%d\n%s", b.page, b.line, b.code)
		if !b.program() {
			src = fragmentFile(b)
		}
		for _, e := range typeCheck(fset, imp, src, b.program()) {
			t.Errorf("%s", e)
		}
	}
	assert.Greater(t, len(blocks), 10, "Go blocks found")
}

// TestDocsGoBlocksCheckerFailsOnABrokenBlock keeps the check above honest:
// a block that names something that does not exist fails it.
func TestDocsGoBlocksCheckerFailsOnABrokenBlock(t *testing.T) {
	if testing.Short() {
		t.Skip("uses the go command; skipped with -short")
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "source", nil)
	b := goBlock{page: "broken.md", line: 7, code: "var x int = \"no\"\n"}
	errs := typeCheck(fset, imp, fmt.Sprintf("//line %s:%d\npackage snippet\n%s", b.page, b.line, b.code), true)
	require.Len(t, errs, 1)
	assert.Contains(t, errs[0], "broken.md:8")
	b = goBlock{page: "broken.md", line: 3, code: "unused := 1\nreturn errors.New(\"fragment\")\n"}
	assert.Empty(t, typeCheck(fset, importer.ForCompiler(fset, "source", nil),
		"package snippet\nimport \"errors\"\nfunc _() error {\n"+b.code+"}\n", false))
}

func goEnv(t *testing.T, name string) string {
	t.Helper()
	out, err := exec.Command("go", "env", name).Output()
	require.NoError(t, err)
	return strings.TrimSpace(string(out))
}

// TestREADMEProgram builds README's program, runs it against an embedded
// miniredis whose clock stands still, and checks what it promises: 20
// requests of one client IP pass, the next are refused with 429 and
// Retry-After, and an interrupt ends it cleanly.
func TestREADMEProgram(t *testing.T) {
	if testing.Short() {
		t.Skip("builds README's program with the go command; skipped with -short")
	}
	var programs []goBlock
	for _, b := range goBlocks(t, "README.md") {
		if b.program() {
			programs = append(programs, b)
		}
	}
	require.Len(t, programs, 1, "README holds one complete program")

	// Inside the module, so that it builds with this tollgate; the
	// underscore keeps it out of ./... patterns while it exists.
	dir, err := os.MkdirTemp(".", "_docs_test_")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(programs[0].code), 0o644))
	bin := filepath.Join(t.TempDir(), "hello")
	for _, args := range [][]string{{"vet", "./" + dir}, {"build", "-o", bin, "./" + dir}} {
		out, err := exec.Command("go", args...).CombinedOutput()
		require.NoError(t, err, "go %s: %s", args[0], out)
	}

	mr := miniredis.RunT(t)
	mr.SetTime(time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC))
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "REDIS_URL=redis://"+mr.Addr()+"/0", "ADDR=127.0.0.1:0")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	url := listeningOn(t, stderr)

	var codes []int
	var retryAfter string
	for range 25 {
		resp, err := http.Get(url)
		require.NoError(t, err)
		_ = resp.Body.Close()
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == http.StatusTooManyRequests && retryAfter == "" {
			retryAfter = resp.Header.Get("Retry-After")
		}
	}
	assert.Equal(t, slices.Repeat([]int{http.StatusOK}, 20), codes[:20])
	assert.Equal(t, slices.Repeat([]int{http.StatusTooManyRequests}, 5), codes[20:])
	assert.Equal(t, "1", retryAfter)

	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	assert.NoError(t, cmd.Wait(), "the program ends cleanly on an interrupt")
}

// listeningOn reads the program's log until it says where it listens, and
// keeps draining the log after that.
func listeningOn(t *testing.T, log io.Reader) string {
	t.Helper()
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(log)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var seen []string
	timeout := time.After(time.Minute)
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				require.FailNow(t, "the program ended before it listened", "%s", strings.Join(seen, "\n"))
			}
			if _, url, found := strings.Cut(line, "listening on "); found {
				go func() {
					for range lines {
					}
				}()
				return url
			}
			seen = append(seen, line)
		case <-timeout:
			require.FailNow(t, "the program did not say where it listens within a minute", "%s", strings.Join(seen, "\n"))
		}
	}
}

// TestDocsLinksResolve checks that every relative link of the Markdown
// pages names a file that exists and, with a #fragment, a heading of it:
// moving a section must not leave a link behind.
func TestDocsLinksResolve(t *testing.T) {
	pages := docPages(t)
	adrs, err := filepath.Glob("docs/adr/*.md")
	require.NoError(t, err)
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, page := range append(pages, adrs...) {
		data, err := os.ReadFile(page)
		require.NoError(t, err)
		for _, m := range link.FindAllStringSubmatch(string(data), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			file := page
			if path != "" {
				file = filepath.Join(filepath.Dir(page), path)
			}
			if _, err := os.Stat(file); err != nil {
				t.Errorf("%s: link %s: no file %s", page, target, file)
				continue
			}
			if anchor != "" && !slices.Contains(headingAnchors(t, file), anchor) {
				t.Errorf("%s: link %s: no heading #%s in %s", page, target, anchor, file)
			}
		}
	}
}

// headingAnchors returns the anchors GitHub makes of a page's headings:
// lower case, spaces as hyphens, other punctuation dropped.
func headingAnchors(t *testing.T, page string) []string {
	t.Helper()
	data, err := os.ReadFile(page)
	require.NoError(t, err)
	var anchors []string
	fenced := false
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
		}
		heading := strings.TrimLeft(line, "#")
		if fenced || heading == line || !strings.HasPrefix(heading, " ") {
			continue
		}
		anchors = append(anchors, strings.Map(func(r rune) rune {
			switch {
			case r == ' ':
				return '-'
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				return unicode.ToLower(r)
			}
			return -1
		}, strings.TrimSpace(heading)))
	}
	return anchors
}
