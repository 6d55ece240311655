package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// This file holds a deliberately tiny RESP2 client used to set up and probe
// servers. It starts no goroutines, needs no handshake (no HELLO, no CLIENT
// SETINFO) and bounds every call with a deadline, which keeps start-up fast
// and predictable.

const (
	dialTimeout = time.Second
	cmdTimeout  = 2 * time.Second
)

// replyError is an error reply ("-ERR ...") sent by the server. The connection
// that received it stays usable.
type replyError string

func (e replyError) Error() string { return string(e) }

// conn is a lazily dialled RESP2 connection to one address. It redials after
// any I/O or protocol error. It is not safe for concurrent use.
type conn struct {
	addr string
	nc   net.Conn
	br   *bufio.Reader
}

func (c *conn) close() {
	if c.nc != nil {
		_ = c.nc.Close()
		c.nc, c.br = nil, nil
	}
}

// do sends one command and reads its reply. Replies are decoded as string
// (simple and bulk strings), int64, nil, []any or replyError (returned as err).
func (c *conn) do(args ...string) (any, error) {
	if c.nc == nil {
		nc, err := net.DialTimeout("tcp", c.addr, dialTimeout)
		if err != nil {
			return nil, err
		}
		c.nc, c.br = nc, bufio.NewReader(nc)
	}
	if err := c.nc.SetDeadline(time.Now().Add(cmdTimeout)); err != nil {
		c.close()
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := io.WriteString(c.nc, b.String()); err != nil {
		c.close()
		return nil, err
	}
	v, err := readReply(c.br)
	var re replyError
	if err != nil && !errors.As(err, &re) {
		c.close()
	}
	return v, err
}

// doString is do for commands whose reply is a string.
func (c *conn) doString(args ...string) (string, error) {
	v, err := c.do(args...)
	if err != nil {
		return "", err
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("%s: unexpected reply %T to %q", c.addr, v, args[0])
	}
	return s, nil
}

// command runs one command on a fresh connection to addr.
func command(addr string, args ...string) (any, error) {
	c := &conn{addr: addr}
	defer c.close()
	return c.do(args...)
}

// commandString runs one command whose reply is a string on a fresh connection.
func commandString(addr string, args ...string) (string, error) {
	c := &conn{addr: addr}
	defer c.close()
	return c.doString(args...)
}

func readReply(br *bufio.Reader) (any, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
	if line == "" {
		return nil, errors.New("resp: empty reply line")
	}
	body := line[1:]
	switch line[0] {
	case '+':
		return body, nil
	case '-':
		return nil, replyError(body)
	case ':':
		return strconv.ParseInt(body, 10, 64)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil {
			return nil, fmt.Errorf("resp: bad bulk length %q", body)
		}
		if n < 0 {
			return nil, nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(br, buf); err != nil {
			return nil, err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil {
			return nil, fmt.Errorf("resp: bad array length %q", body)
		}
		if n < 0 {
			return nil, nil
		}
		arr := make([]any, n)
		for i := range arr {
			v, err := readReply(br)
			var re replyError
			if err != nil && !errors.As(err, &re) {
				return nil, err
			}
			if err != nil {
				v = err
			}
			arr[i] = v
		}
		return arr, nil
	default:
		return nil, fmt.Errorf("resp: unexpected reply type %q", line)
	}
}

// infoField returns the value of field in the output of INFO, or "".
func infoField(info, field string) string {
	for _, l := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimRight(l, "\r"), ":"); ok && k == field {
			return v
		}
	}
	return ""
}

// pairs turns a flat RESP2 array of alternating keys and values into a map.
func pairs(v any) map[string]string {
	arr, _ := v.([]any)
	m := make(map[string]string, len(arr)/2)
	for i := 0; i+1 < len(arr); i += 2 {
		k, _ := arr[i].(string)
		val, _ := arr[i+1].(string)
		m[k] = val
	}
	return m
}
