package redisscript

import (
	"context"
	"fmt"
)

// Grouped runs many calls of a Function in one call of it, each call
// with one key, args of its own and args that the calls next to it may
// share: a call's Args[:own] are its own, and Args[own:] are its
// group's, sent once for a run of calls, one after the other, whose
// Args[own:] are equal. The function gets KEYS, the calls' keys in their
// order; ARGV[1], the number of groups; then, group after group, its
// number of calls, its calls' own args if they are all equal, else as
// many empty strings, and its shared args; then the own args of each call
// of a group whose calls differ in them, in the order of KEYS. It replies
// one string of records (ReplyLua's record and errorRecord): the first
// shared by every call, then one per call, in the order of KEYS, which
// must not begin with '-'. It is safe for concurrent use.
type Grouped struct {
	f   *Function
	own int
}

// Record is one call's reply from a Grouped: the first record of the
// function's reply, which every call shares, and the call's own.
type Record struct {
	Shared, Own string
}

// NewGrouped returns the Grouped of the function f, whose calls have own
// args of their own.
func NewGrouped(f *Function, own int) *Grouped { return &Grouped{f: f, own: own} }

// Loads returns the function's Loads.
func (g *Grouped) Loads() int64 { return g.f.Loads() }

// Run runs calls, in their order, in one call of the function on c, and
// sets each call's Reply, a Record, or Err. A library or script Redis
// lacks is loaded as Function.Run loads it.
func (g *Grouped) Run(ctx context.Context, c Client, calls []*Call) {
	keys := make([]string, 0, len(calls))
	args := []any{0}
	groups, at, n := 0, 0, 0 // at: the index in args of the current group's count, n
	for i, call := range calls {
		keys = append(keys, call.Keys...)
		if i == 0 || !sameArgs(calls[i-1].Args[g.own:], call.Args[g.own:]) {
			args[at] = n
			groups, at, n = groups+1, len(args), 0
			args = append(append(args, 0), call.Args...)
		} else if own := args[at+1 : at+1+g.own]; !sameArgs(own, call.Args[:g.own]) {
			for j := range own {
				own[j] = "" // the calls' own args follow the groups
			}
		}
		n++
	}
	args[at] = n
	args[0] = groups
	for i, h := 0, 1; i < len(calls); { // h: the index in args of call i's group's count
		n := args[h].(int)
		if g.own > 0 && args[h+1] == "" {
			for _, call := range calls[i : i+n] {
				args = append(args, call.Args[:g.own]...)
			}
		}
		h += 1 + len(calls[i].Args)
		i += n
	}
	reply, err := g.f.Run(ctx, c, keys, args...)
	deliverRecords(calls, reply, err)
}

// deliverRecords hands each of calls its Record of a Grouped's reply, or
// its error; or err, the call's own, to all if the call failed.
func deliverRecords(calls []*Call, reply any, err error) {
	s, ok := reply.(string)
	if err == nil && (!ok || countRecords(s) != 1+len(calls)) {
		err = fmt.Errorf("%w: want a string of %d records, got %T", ErrBadReply, 1+len(calls), reply)
	}
	if err != nil {
		for _, call := range calls {
			call.Reply, call.Err = nil, err
		}
		return
	}
	shared, s := nextRecord(s)
	for _, call := range calls {
		var own string
		own, s = nextRecord(s)
		call.Reply, call.Err = Record{Shared: shared, Own: own}, nil
		if own != "" && own[0] == '-' {
			call.Reply, call.Err = nil, classError(own[1:])
		}
	}
}

// nextRecord returns the first record of s, a byte n and n bytes, and
// what follows it. s must hold a whole record.
func nextRecord(s string) (record, rest string) {
	n := 1 + int(s[0])
	return s[1:n], s[n:]
}

// countRecords returns how many records s holds, or -1 if it does not
// end with a whole one.
func countRecords(s string) int {
	n := 0
	for len(s) > 0 {
		if 1+int(s[0]) > len(s) {
			return -1
		}
		_, s = nextRecord(s)
		n++
	}
	return n
}

// classError returns the *Error of the class an errorRecord holds: ERR if
// Redis has no such class.
func classError(class string) *Error {
	if !classes[class] {
		class = "ERR"
	}
	return &Error{Class: class}
}

// sameArgs reports whether a and b hold the same args: strings and
// numbers alike, anything else never the same, so that no arg of a type
// that == cannot compare makes it panic.
func sameArgs(a, b []any) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !sameArg(a[i], b[i]) {
			return false
		}
	}
	return true
}

// sameArg reports whether a and b are the same string or number.
func sameArg(a, b any) bool {
	switch x := a.(type) {
	case string:
		y, ok := b.(string)
		return ok && x == y
	case int64:
		y, ok := b.(int64)
		return ok && x == y
	case int:
		y, ok := b.(int)
		return ok && x == y
	case float64:
		y, ok := b.(float64)
		return ok && x == y
	}
	return false
}
