// Package isnil tells a nil value held in an interface from a usable one.
package isnil

import "reflect"

// Value reports whether v is nil: a nil interface, or an interface that
// holds a nil pointer, func, map, chan, slice or interface, such as a
// *redis.Client that was declared and never set. A method called on such
// a value panics, so constructors refuse it.
func Value(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.UnsafePointer, reflect.Func, reflect.Map, reflect.Chan, reflect.Slice, reflect.Interface:
		return rv.IsNil()
	}
	return false
}
