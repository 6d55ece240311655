package redisscript

import "context"

// Grouped runs many calls of a Function in one call of it, each call
// with one key, args of its own and args that the calls next to it may
// share: a call's Args[:own] are its own, and Args[own:] are its
// group's, sent once for a run of calls, one after the other, whose
// Args[own:] are equal. The function gets KEYS, the calls' keys in their
// order; ARGV[1], the number of groups; then, group after group, its
// number of calls and its shared args; then each call's own args, in the
// order of KEYS. It replies as a Batch does: an array of an element per
// call, in the order of KEYS, its integers packed by packInts (ReplyLua)
// or callError's error. It is safe for concurrent use.
type Grouped struct {
	f   *Function
	own int
}

// NewGrouped returns the Grouped of the function f, whose calls have own
// args of their own.
func NewGrouped(f *Function, own int) *Grouped { return &Grouped{f: f, own: own} }

// Loads returns the function's Loads.
func (g *Grouped) Loads() int64 { return g.f.Loads() }

// Run runs calls, in their order, in one call of the function on c, and
// sets each call's Reply or Err. A library or script Redis lacks is
// loaded as Function.Run loads it.
func (g *Grouped) Run(ctx context.Context, c Client, calls []*Call) {
	keys := make([]string, 0, len(calls))
	args := []any{0}
	groups, at, n := 0, 0, 0 // at: the index in args of the current group's count, n
	for i, call := range calls {
		keys = append(keys, call.Keys...)
		if i == 0 || !sameArgs(calls[i-1].Args[g.own:], call.Args[g.own:]) {
			args[at] = n
			groups, at, n = groups+1, len(args), 0
			args = append(append(args, 0), call.Args[g.own:]...)
		}
		n++
	}
	args[at] = n
	args[0] = groups
	for _, call := range calls {
		args = append(args, call.Args[:g.own]...)
	}
	reply, err := g.f.Run(ctx, c, keys, args...)
	deliver(calls, reply, err)
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
