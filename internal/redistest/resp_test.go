package redistest

import (
	"bufio"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestReadReply(t *testing.T) {
	tests := []struct {
		name string
		wire string
		want any    // when there is no error
		err  string // a substring of the error, or "" for none
	}{
		{"simple string", "+PONG\r\n", "PONG", ""},
		{"error", "-ERR unknown command\r\n", nil, "ERR unknown command"},
		{"integer", ":-42\r\n", int64(-42), ""},
		{"bulk string", "$5\r\nhello\r\n", "hello", ""},
		{"bulk string with CRLF inside", "$4\r\na\r\nb\r\n", "a\r\nb", ""},
		{"null bulk string", "$-1\r\n", nil, ""},
		{"empty array", "*0\r\n", []any{}, ""},
		{"null array", "*-1\r\n", nil, ""},
		{"nested array", "*2\r\n$1\r\na\r\n*1\r\n:1\r\n", []any{"a", []any{int64(1)}}, ""},
		{"error inside an array", "*2\r\n-ERR x\r\n+OK\r\n", []any{replyError("ERR x"), "OK"}, ""},
		{"bad integer", ":x\r\n", nil, "invalid syntax"},
		{"bad bulk length", "$x\r\n", nil, "bad bulk length"},
		{"bad array length", "*x\r\n", nil, "bad array length"},
		{"unknown type", "?1\r\n", nil, "unexpected reply type"},
		{"empty line", "\r\n", nil, "empty reply line"},
		{"truncated bulk string", "$5\r\nhel", nil, "EOF"},
		{"truncated array", "*2\r\n+OK\r\n", nil, "EOF"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := readReply(bufio.NewReader(strings.NewReader(tt.wire)))
			if tt.err == "" && err != nil || tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) {
				t.Fatalf("readReply(%q) error = %v, want %q", tt.wire, err, tt.err)
			}
			if err == nil && !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("readReply(%q) = %#v, want %#v", tt.wire, got, tt.want)
			}
		})
	}
	var re replyError
	if _, err := readReply(bufio.NewReader(strings.NewReader("-ERR x\r\n"))); !errors.As(err, &re) {
		t.Fatalf("an error reply is a replyError, so the connection stays usable; got %T", err)
	}
}

func TestInfoField(t *testing.T) {
	info := "# Replication\r\nrole:slave\r\nmaster_link_status:up\r\nmaster_host:127.0.0.1\r\n"
	for field, want := range map[string]string{
		"role": "slave", "master_link_status": "up", "master_host": "127.0.0.1", "missing": "", "# Replication": "",
	} {
		if got := infoField(info, field); got != want {
			t.Errorf("infoField(%q) = %q, want %q", field, got, want)
		}
	}
}

func TestPairs(t *testing.T) {
	got := pairs([]any{"flags", "slave", "port", "6380", "odd"})
	want := map[string]string{"flags": "slave", "port": "6380"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("pairs = %v, want %v", got, want)
	}
	if got := pairs("not an array"); len(got) != 0 {
		t.Fatalf("pairs of a non-array = %v, want empty", got)
	}
}
