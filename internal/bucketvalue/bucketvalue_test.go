package bucketvalue

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestEncodeTakesTheFewestBytes(t *testing.T) {
	for _, c := range []struct {
		tokens int64
		n      int
	}{{0, 8}, {255, 8}, {256, 9}, {1<<16 - 1, 9}, {1 << 16, 10}, {100_000_000, 11}, {1<<40 - 1, 12}, {1 << 48, 14}, {max53, 14}} {
		v := Encode(Bucket{Tokens: c.tokens, Stamp: 1_795_341_600_123_456})
		assert.Len(t, v, c.n, "tokens %d", c.tokens)
	}
	assert.Len(t, Encode(Bucket{Tokens: 1, Stamp: 1, Version: 1, Capacity: 1}), 28, "a version takes 7 bytes a field")
}

func TestDecodeReadsWhatEncodeWrote(t *testing.T) {
	for _, b := range []Bucket{
		{},
		{Tokens: 3_000_000, Stamp: 1_700_000_000_000_000},
		{Tokens: max53, Stamp: max53},
		{Tokens: 256, Stamp: 255},
		{Tokens: 2_500_000, Stamp: 1_795_341_601_123_456, Version: 3, Capacity: 4},
		{Tokens: max53, Stamp: max53, Version: max53, Capacity: max53},
	} {
		got, ok := Decode(Encode(b))
		assert.True(t, ok, "%+v", b)
		assert.Equal(t, b, got)
	}
	// Big-endian, stamp first: the layout the scripts read.
	assert.Equal(t, "\x00\x00\x00\x00\x00\x01\x02\x03\x04", Encode(Bucket{Tokens: 0x0304, Stamp: 0x0102}))
}

// TestDecodeRefusesWhatIsNotABucket: other lengths, and numbers beyond
// 2^53, are not buckets; the scripts read them as full.
func TestDecodeRefusesWhatIsNotABucket(t *testing.T) {
	for _, v := range []string{
		"", "hello", strings.Repeat("\x00", 7), strings.Repeat("\x00", 15), strings.Repeat("\x00", 27), strings.Repeat("\x00", 29),
		"\x00\x00\x00\x00\x00\x00\x00" + "\x20\x00\x00\x00\x00\x00\x01", // tokens 2^53 + 1
		"\x20\x00\x00\x00\x00\x00\x01" + "\x00",                         // stamp 2^53 + 1
		strings.Repeat("\xff", 14),
		strings.Repeat("\x00", 7) + strings.Repeat("\xff", 7) + strings.Repeat("\x00", 14), // versioned, tokens beyond 2^53
	} {
		_, ok := Decode(v)
		assert.False(t, ok, "%q", v)
	}
}
