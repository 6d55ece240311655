// Package bucketvalue reads and writes a token bucket as RedisStore keeps
// it, a string of big-endian whole numbers (scripts/bucket.lua writes
// it): the stamp in µs in 7 bytes, then the micro-tokens in as few
// bytes as hold them (1 to 7); or, once a plan with a version wrote it,
// 28 bytes: stamp, micro-tokens, plan version and capacity in tokens, 7
// bytes each. The scripts are its only writers in production; the CLI
// and the tests read it, and the tests plant buckets with it.
package bucketvalue

// max53 is the largest number the scripts read: 2^53, exact in a double.
const max53 = 1 << 53

// Bucket is one stored bucket.
type Bucket struct {
	Tokens   int64 // micro-tokens
	Stamp    int64 // µs since the Unix epoch, on Redis's clock
	Version  int64 // the highest plan version that wrote it; 0 if none
	Capacity int64 // tokens, as of the last write by a plan with a version
}

// Encode returns b as the scripts write it. Every field must lie in [0,
// 2^53].
func Encode(b Bucket) string {
	out := appendBytes(nil, b.Stamp, 7)
	if b.Version > 0 {
		out = appendBytes(out, b.Tokens, 7)
		out = appendBytes(out, b.Version, 7)
		return string(appendBytes(out, b.Capacity, 7))
	}
	n := 1
	for x := b.Tokens >> 8; x > 0; x >>= 8 {
		n++
	}
	return string(appendBytes(out, b.Tokens, n))
}

// Decode reads s as the scripts do, and reports whether it is a bucket:
// anything else (another length, a number above 2^53) the scripts read
// as a full bucket, and replace when they write.
func Decode(s string) (Bucket, bool) {
	n := len(s)
	if n < 8 || (n > 14 && n != 28) {
		return Bucket{}, false
	}
	b := Bucket{Stamp: number(s[:7])}
	if n == 28 {
		b.Tokens, b.Version, b.Capacity = number(s[7:14]), number(s[14:21]), number(s[21:])
	} else {
		b.Tokens = number(s[7:])
	}
	if b.Tokens > max53 || b.Stamp > max53 {
		return Bucket{}, false
	}
	return b, true
}

// appendBytes appends the low n bytes of x, big-endian.
func appendBytes(out []byte, x int64, n int) []byte {
	for i := n - 1; i >= 0; i-- {
		out = append(out, byte(x>>(8*i)))
	}
	return out
}

// number reads s as a big-endian whole number of at most 7 bytes.
func number(s string) int64 {
	var x int64
	for i := 0; i < len(s); i++ {
		x = x<<8 | int64(s[i])
	}
	return x
}
