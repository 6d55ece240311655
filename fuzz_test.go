package tollgate

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// Fuzz targets for the parts that take arbitrary input: the bucket math,
// the key scheme, and the parsing of script replies. Their seeds (f.Add and
// testdata/fuzz/<Name>) run in every go test; to fuzz, one target at a time:
//
//	go test -run '^$' -fuzz '^FuzzBucket$' -fuzztime 20s .

// FuzzBucket drives one bucket through a fuzzed plan and a fuzzed sequence
// of takes (cost 0 is a read) at times that jump forwards and backwards,
// and checks after every step that the tokens stay within 0 and the
// capacity, that the stamp never moves back (unless the clock stepped back
// by more than a full refill) nor past the time, that Take
// succeeds exactly when ReadyAt says the tokens are there, and that a denied
// request passes at ReadyAt and not a microsecond earlier. At the end, the tokens admitted may not exceed capacity + rate ×
// elapsed, elapsed being how far time ever got past the start.
func FuzzBucket(f *testing.F) {
	f.Add(int64(3), 2.0, []byte{0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0x01, 0xf4, 1})
	f.Add(int64(1), 1.0/3, []byte{1, 0, 1, 1, 2, 0xff, 0xff, 1, 2, 0, 3, 1})
	f.Add(int64(MaxCapacity), 1e9, []byte{3, 0x7f, 0xff, 0xff, 0, 0, 1, 0xff})
	f.Add(int64(1000), Per(1000, 24*time.Hour), []byte{2, 0, 86, 200, 3, 0x80, 0, 7})
	f.Add(int64(17), 7.77, []byte{0, 0, 3, 17, 1, 0, 128, 1, 0, 0x80, 0x01, 2})
	f.Fuzz(func(t *testing.T, capacity int64, rate float64, ops []byte) {
		p := Plan{Name: "f", Capacity: capacity, Rate: rate}
		if p.validateNumbers() != nil {
			return // New rejects such plans
		}
		full := capacity * MicroTokens
		b := FullBucket(p, t0)
		now, reached := t0, t0
		admitted, steps := int64(0), int64(0) // micro-tokens admitted
		resets := int64(0)                    // clock steps back by more than a full refill
		segment, accrued := t0, 0.0           // a reset starts a new span of time to accrue in
		for len(ops) >= 4 {
			op := ops[:4]
			ops = ops[4:]
			steps++
			// op[0] picks the scale of the time step, op[1:3] its size and
			// sign, op[3] the cost.
			scale := []int64{1, 1_000, 1_000_000, 1_000_000_000}[op[0]%4]
			now += int64(int16(binary.BigEndian.Uint16(op[1:3]))) * scale
			now = min(max(now, 0), t0+MaxRefillPeriod.Microseconds()) // Redis TIME: after 1970, before 2123
			cost := int64(op[3])
			if op[0]&4 != 0 {
				cost = capacity // the largest cost
			}
			cost = min(cost, capacity)

			ready := b.ReadyAt(p, now, cost)
			next, ok := b.Take(p, now, cost)
			if next.Tokens < 0 || next.Tokens > full {
				t.Fatalf("step %d: %d micro-tokens, outside 0..%d", steps, next.Tokens, full)
			}
			if next.Stamp < b.Stamp {
				// Only a stamp more than a full refill ahead gives way: the
				// bucket then reads as full as of now.
				if float64(b.Stamp-now) <= float64(full)/rate || b.Refill(p, now) != FullBucket(p, now) {
					t.Fatalf("step %d: stamp moved back from %d to %d", steps, b.Stamp, next.Stamp)
				}
				resets++
				accrued += rate * float64(reached-segment)
				segment, reached = now, now
			}
			if next.Stamp > max(now, b.Stamp) {
				t.Fatalf("step %d: stamp %d is past now %d", steps, next.Stamp, now)
			}
			if ready < now || ok != (ready == now) {
				t.Fatalf("step %d: Take(%d) = %v but ReadyAt = %d (now %d)", steps, cost, ok, ready, now)
			}
			if !ok {
				if _, ok := b.Take(p, ready, cost); !ok {
					t.Fatalf("step %d: denied at ReadyAt %d (bucket %+v, cost %d)", steps, ready, b, cost)
				}
				// ReadyAt is the first microsecond at which Take finds the
				// tokens in the bucket as stored: no earlier.
				if _, early := b.Take(p, ready-1, cost); early && ready-1 > now {
					t.Fatalf("step %d: passes at %d, before ReadyAt %d (bucket %+v, cost %d)", steps, ready-1, ready, b, cost)
				}
			}
			if ok {
				admitted += cost * MicroTokens
			}
			b, reached = next, max(reached, now)
		}
		// Each refill may round up by less than a micro-token; steps covers
		// it. Each reset by a clock step back gives one more bucketful.
		accrued += rate * float64(reached-segment)
		bound := float64(full)*float64(1+resets) + accrued + float64(steps)
		if float64(admitted) > bound {
			t.Fatalf("admitted %d micro-tokens after %d resets; bound %.0f", admitted, resets, bound)
		}
	})
}

// decodeRedisKey reads (key, plan) back from a Redis key made by Key with
// prefix, as ADR 0003 says can be done: the first '}' after the first '{'
// ends the key's part; '=' marks base64url.
func decodeRedisKey(prefix, rk string) (key, plan string, ok bool) {
	rest, ok := strings.CutPrefix(rk, prefix+":{")
	if !ok {
		return "", "", false
	}
	k, plan, ok := strings.Cut(rest, "}:")
	if !ok {
		return "", "", false
	}
	if enc, ok := strings.CutPrefix(k, "="); ok {
		raw, err := base64.RawURLEncoding.DecodeString(enc)
		if err != nil {
			return "", "", false
		}
		return string(raw), plan, true
	}
	return k, plan, true
}

// FuzzKey checks the key scheme on fuzzed keys, plans and prefixes: Key
// never panics, whatever it is given; for valid input, the Redis key reads
// back as the (key, plan) it came from, so the mapping is injective; two
// different pairs never share a Redis key; and every plan of a key shares
// one Cluster hash tag, which is never empty.
func FuzzKey(f *testing.F) {
	for _, k := range adversarialKeys[:len(adversarialKeys)-2] {
		f.Add(DefaultKeyPrefix, k, "gold", k+"}", "daily")
	}
	f.Add("app:v2", "user:42", "a.b-c_d", "user:42}", "a.b-c_d")
	f.Add("x", "=", "p", "", "p")
	f.Fuzz(func(t *testing.T, prefix, key1, plan1, key2, plan2 string) {
		if strings.ContainsAny(prefix, "{}") {
			prefix = DefaultKeyPrefix // NewRedisStore rejects the others
		}
		s := NewRedisStore(nil, WithKeyPrefix(prefix))
		rk1, rk2 := s.Key(key1, plan1), s.Key(key2, plan2) // never a panic, even for invalid input
		valid := func(key, plan string) bool {
			return checkKey(key) == nil && Plan{Name: plan, Capacity: 1, Rate: 1}.validate() == nil
		}
		for _, c := range []struct{ key, plan, rk string }{{key1, plan1, rk1}, {key2, plan2, rk2}} {
			if !valid(c.key, c.plan) {
				continue
			}
			k, p, ok := decodeRedisKey(prefix, c.rk)
			if !ok || k != c.key || p != c.plan {
				t.Fatalf("Key(%q, %q) = %q reads back as (%q, %q, %v)", c.key, c.plan, c.rk, k, p, ok)
			}
			tag := hashTag(c.rk)
			if tag == "" || tag == c.rk {
				t.Fatalf("Key(%q, %q) = %q: no hash tag", c.key, c.plan, c.rk)
			}
			for _, other := range []string{"gold", plan1, plan2} {
				if valid(c.key, other) && hashTag(s.Key(c.key, other)) != tag {
					t.Fatalf("key %q: plans %q and %q have different hash tags", c.key, c.plan, other)
				}
			}
		}
		if valid(key1, plan1) && valid(key2, plan2) && (key1 != key2 || plan1 != plan2) && rk1 == rk2 {
			t.Fatalf("(%q, %q) and (%q, %q) share the Redis key %q", key1, plan1, key2, plan2, rk1)
		}
	})
}

// replyReader builds a script reply, and the plans it is for, from fuzzed
// bytes: every shape go-redis can hand over (integers, strings, nil,
// nested arrays, floats, errors, bytes, booleans) and, often, the shape
// the script returns with values near the bounds.
type replyReader struct{ b []byte }

func (r *replyReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *replyReader) int64() int64 {
	var buf [8]byte
	n := copy(buf[:], r.b)
	r.b = r.b[n:]
	return int64(binary.BigEndian.Uint64(buf[:]))
}

// near returns a value near the edges a reply's integer must respect.
func (r *replyReader) near(limit int64) int64 {
	switch r.byte() % 8 {
	case 0:
		return 0
	case 1:
		return 1
	case 2:
		return -1
	case 3:
		return limit
	case 4:
		return limit + 1
	case 5:
		return t0
	case 6:
		return math.MinInt64
	}
	return r.int64()
}

func (r *replyReader) value(plans []Plan, depth int) any {
	switch tag := r.byte(); tag % 11 {
	case 0:
		return r.int64()
	case 1:
		return int64(int8(r.byte()))
	case 2:
		return string(make([]byte, r.byte()%8))
	case 3:
		return nil
	case 4, 5:
		n := int(r.byte() % 8)
		if tag%11 == 5 {
			n = 2 + 2*len(plans) // the right length, maybe the wrong contents
		}
		if depth > 3 {
			n = 0
		}
		arr := make([]any, n)
		for i := range arr {
			arr[i] = r.value(plans, depth+1)
		}
		return arr
	case 6:
		return math.Float64frombits(uint64(r.int64()))
	case 7:
		return errors.New("ERR fuzzed")
	case 8:
		return []byte{r.byte()}
	case 9:
		return r.byte()%2 == 0
	}
	// The script's shape: {allowed, now, tokens_1, stamp_1, ...}.
	arr := []any{r.near(1), r.near(t0)}
	for _, p := range plans {
		arr = append(arr, r.near(p.Capacity*MicroTokens), r.near(t0))
	}
	return arr
}

// wellFormed is parseReply's contract, written independently: an array of
// 2+2n integers, a flag of 0 or 1, each bucket's tokens within 0 and its
// plan's capacity.
func wellFormed(reply any, plans []Plan) bool {
	arr, ok := reply.([]any)
	if !ok || len(arr) != 2+2*len(plans) {
		return false
	}
	for _, v := range arr {
		if _, ok := v.(int64); !ok {
			return false
		}
	}
	for _, v := range arr {
		if x := v.(int64); x < 0 || x > 1<<53 {
			return false // beyond what Lua's doubles hold exactly
		}
	}
	return arr[0].(int64) <= 1 // the allowed flag
}

// FuzzParseReply hands parseReply replies of fuzzed shapes: it never
// panics, and it accepts exactly the well-formed ones, returning their
// values; every other reply is an error wrapping ErrBadReply.
func FuzzParseReply(f *testing.F) {
	// data: plans-1, then per plan a, b, m (capacity 1+a×b, MaxCapacity
	// if m%8 == 0), then the reply; tag 10 is the script's shape, whose
	// values are chosen by near.
	f.Add([]byte{0, 1, 3, 1, 10, 1, 5, 3, 5})                                              // good: tokens at the capacity
	f.Add([]byte{0, 1, 3, 1, 10, 1, 5, 4, 5})                                              // tokens one above the capacity: Refill clamps
	f.Add([]byte{0, 1, 3, 1, 10, 2, 5, 0, 5})                                              // flag -1
	f.Add([]byte{0, 1, 3, 1, 5, 0, 2, 0, 3, 6, 0, 0, 0, 0, 0, 0, 0, 0, 9, 1})              // the right length, wrong types
	f.Add([]byte{0, 1, 3, 1, 4, 3, 4, 2, 4, 1, 4, 0})                                      // nested arrays
	f.Add([]byte{3, 1, 1, 0, 2, 2, 1, 3, 3, 1, 4, 4, 1, 10, 0, 5, 3, 5, 0, 5, 1, 5, 3, 6}) // four plans, one of MaxCapacity
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &replyReader{b: data}
		plans := make([]Plan, 1+r.byte()%4)
		for i := range plans {
			plans[i] = Plan{Name: "p", Capacity: 1 + int64(r.byte())*int64(r.byte())}
			if r.byte()%8 == 0 {
				plans[i].Capacity = MaxCapacity
			}
		}
		reply := r.value(plans, 0)
		allowed, now, buckets, err := parseReply(reply, plans)
		if !wellFormed(reply, plans) {
			if !errors.Is(err, ErrBadReply) {
				t.Fatalf("reply %#v for %d plans: err %v, want ErrBadReply", reply, len(plans), err)
			}
			return
		}
		if err != nil {
			t.Fatalf("well-formed reply %#v rejected: %v", reply, err)
		}
		arr := reply.([]any)
		if allowed != (arr[0] == int64(1)) || now != arr[1] || len(buckets) != len(plans) {
			t.Fatalf("reply %#v parsed as %v, %d, %v", reply, allowed, now, buckets)
		}
		for i, b := range buckets {
			if b.Tokens != arr[2+2*i] || b.Stamp != arr[3+2*i] {
				t.Fatalf("reply %#v: bucket %d parsed as %+v", reply, i, b)
			}
		}
	})
}
