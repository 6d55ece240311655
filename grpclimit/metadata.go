package grpclimit

import (
	"strconv"

	"google.golang.org/grpc/metadata"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/ratefields"
)

// allowedMetadata returns the header metadata of an allowed call, or nil.
func (s *server) allowedMetadata(res *tollgate.Result) metadata.MD {
	if !s.allowedMD || s.metadata == MetadataNone {
		return nil
	}
	var f fields
	f.buf = f.arr[:0]
	s.appendFields(&f, res)
	return f.md()
}

// deniedMetadata returns the trailer metadata of a denied call.
func (s *server) deniedMetadata(res *tollgate.Result) metadata.MD {
	var f fields
	f.buf = f.arr[:0]
	if s.metadata != MetadataNone {
		s.appendFields(&f, res)
	}
	if ratefields.Concurrent(res, s.planner) {
		return f.md() // a permit comes back on no schedule: no time to tell
	}
	f.buf = ratefields.AppendRetryAfter(f.buf, res)
	f.end(mdRetryAfter)
	if s.pushback {
		f.buf = strconv.AppendInt(f.buf, retryDelay(res.RetryAfter).Milliseconds(), 10)
		f.end(mdPushback)
	}
	return f.md()
}

func (s *server) appendFields(f *fields, res *tollgate.Result) {
	f.buf = ratefields.AppendPolicy(f.buf, res, s.planner, false)
	f.end(mdPolicy)
	f.buf = ratefields.AppendRateLimit(f.buf, res, s.planner, false)
	f.end(mdRateLimit)
	if s.metadata == MetadataBoth {
		f.buf = ratefields.AppendLimit(f.buf, res)
		f.end(mdLimit)
		f.buf = ratefields.AppendRemaining(f.buf, res)
		f.end(mdRemaining)
		if !ratefields.Concurrent(res, s.planner) {
			f.buf = ratefields.AppendReset(f.buf, res)
			f.end(mdReset)
		}
	}
}

// A metadata entry that the interceptors send.
type mdName uint8

const (
	mdPolicy mdName = iota
	mdRateLimit
	mdLimit
	mdRemaining
	mdReset
	mdRetryAfter
	mdPushback
	numMD
)

var mdNames = [numMD]string{
	mdPolicy:     "ratelimit-policy",
	mdRateLimit:  "ratelimit",
	mdLimit:      "x-ratelimit-limit",
	mdRemaining:  "x-ratelimit-remaining",
	mdReset:      "x-ratelimit-reset",
	mdRetryAfter: "retry-after",
	mdPushback:   "grpc-retry-pushback-ms",
}

// fields collects the values of a decision's metadata in one buffer, so
// that they cost one string, one []string and the map, not two
// allocations each.
type fields struct {
	arr  [256]byte
	buf  []byte
	ids  [numMD]mdName
	ends [numMD]int
	n    int
}

func (f *fields) end(id mdName) {
	f.ids[f.n], f.ends[f.n] = id, len(f.buf)
	f.n++
}

func (f *fields) md() metadata.MD {
	s := string(f.buf)
	values := make([]string, f.n)
	md := make(metadata.MD, f.n)
	start := 0
	for i := range f.n {
		values[i] = s[start:f.ends[i]]
		// Capacity 1, so that an append by someone else copies.
		md[mdNames[f.ids[i]]] = values[i : i+1 : i+1]
		start = f.ends[i]
	}
	return md
}
