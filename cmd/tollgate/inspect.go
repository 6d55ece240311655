package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/bucketvalue"
)

// microTokens is the number of micro-tokens in a token: buckets count in
// them (docs/adr/0001-token-representation.md).
const microTokens = 1_000_000

// inspect prints, for each plan, the bucket, window or permits of key as
// Redis holds them. It only reads (TIME, TYPE, PTTL, GET, HGETALL,
// ZRANGE), never runs the script, so it
// changes nothing: the stored tokens are as of the refill stamp, before
// the refill the next decision would add.
func inspect(ctx context.Context, w io.Writer, c redis.UniversalClient, prefix, key string, plans []string) error {
	store := tollgate.NewRedisStore(c, tollgate.WithKeyPrefix(prefix))
	now, err := c.Time(ctx).Result()
	if err != nil {
		return fmt.Errorf("read Redis TIME: %w", err)
	}
	fmt.Fprintf(w, "Redis TIME %s (the buckets' clock)\n", formatTime(now.UnixMicro()))
	for _, plan := range plans {
		rk := store.Key(key, plan)
		typ, err := c.Type(ctx, rk).Result()
		if err != nil {
			return fmt.Errorf("TYPE of the bucket of plan %q: %w", plan, err)
		}
		fmt.Fprintf(w, "\n%s\n", strconv.Quote(rk))
		if typ == "none" {
			fmt.Fprintln(w, "  absent: reads as full")
			continue
		}
		ttl, err := c.PTTL(ctx, rk).Result()
		if err != nil {
			return fmt.Errorf("PTTL of the bucket of plan %q: %w", plan, err)
		}
		switch typ {
		case "string":
			v, err := c.Get(ctx, rk).Result()
			if err != nil {
				return fmt.Errorf("GET of the bucket of plan %q: %w", plan, err)
			}
			printBucket(w, v, ttl, now.UnixMicro())
		case "hash":
			h, err := c.HGetAll(ctx, rk).Result()
			if err != nil {
				return fmt.Errorf("HGETALL of the window of plan %q: %w", plan, err)
			}
			printWindow(w, h, ttl, now.UnixMicro())
		case "zset":
			zs, err := c.ZRangeWithScores(ctx, rk, 0, -1).Result()
			if err != nil {
				return fmt.Errorf("ZRANGE of the permits of plan %q: %w", plan, err)
			}
			printPermits(w, zs, ttl, now.UnixMicro())
		default:
			fmt.Fprintf(w, "  type      %s, neither a bucket (string) nor a window (hash): foreign data; reads as full or empty, and the next decision that takes tokens replaces it\n", typ)
			fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
		}
	}
	return nil
}

// printPermits prints a concurrency plan's sorted set: the permits alive
// at now, and each holder's, by the first 8 characters of its id (the
// rest would let a reader release them), with when their lease ends.
// Members are '<holder id>.<j>' scored by the lease's end in µs.
func printPermits(w io.Writer, zs []redis.Z, ttl time.Duration, nowMicro int64) {
	type holder struct {
		id   string
		n    int
		ends int64
	}
	var holders []*holder
	alive := 0
	for _, z := range zs {
		m, _ := z.Member.(string)
		id, _, _ := strings.Cut(m, ".")
		ends := int64(z.Score)
		if ends > nowMicro {
			alive++
		}
		i := slices.IndexFunc(holders, func(h *holder) bool { return h.id == id })
		if i < 0 {
			holders = append(holders, &holder{id: id, ends: ends})
			i = len(holders) - 1
		}
		holders[i].n++
	}
	fmt.Fprintf(w, "  permits   %d held, alive at Redis TIME; %d members in all\n", alive, len(zs))
	for _, h := range holders {
		short := h.id
		if len(short) > 8 {
			short = short[:8] + "…"
		}
		state := fmt.Sprintf("lease ends in %s", time.Duration(h.ends-nowMicro)*time.Microsecond)
		if h.ends <= nowMicro {
			state = fmt.Sprintf("lease ended %s ago: the next decision reclaims them", time.Duration(nowMicro-h.ends)*time.Microsecond)
		}
		fmt.Fprintf(w, "  holder    %s: %d, %s\n", short, h.n, state)
	}
	fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
}

// printWindow prints a sliding window's hash: v = w or s (suppressed),
// the sub-window width in µs and their number k; then, per sub-window
// i = floor(µs / width), the tokens admitted (field i) and, for a
// suppressed plan, offered (field oi), newest first.
func printWindow(w io.Writer, h map[string]string, ttl time.Duration, nowMicro int64) {
	v := h["v"]
	if v == "" || (v[0] != 'w' && v[0] != 's') {
		fmt.Fprintf(w, "  schema    v = %s: a hash but not a window: foreign data; reads as full or empty, and the next decision that takes tokens replaces it\n", strconv.Quote(v))
		fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
		return
	}
	width, k, ok := strings.Cut(v[1:], "/")
	g, errG := strconv.ParseInt(width, 10, 64)
	slots, errK := strconv.ParseInt(k, 10, 64)
	if !ok || errG != nil || errK != nil || g <= 0 || slots <= 0 {
		fmt.Fprintf(w, "  schema    v = %s: foreign data; reads as empty, and the next decision that takes tokens replaces it\n", strconv.Quote(v))
		fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
		return
	}
	kind := "sliding window"
	if v[0] == 's' {
		kind = "suppressed sliding window"
	}
	first := nowMicro/g - slots
	fmt.Fprintf(w, "  %s of %d sub-windows of %s (v = %s); sub-windows from %d on count now\n",
		kind, slots, time.Duration(g)*time.Microsecond, v, first)
	var subs []int64 // sub-windows with a count, admitted or offered
	counted := int64(0)
	for f, c := range h {
		i, err := strconv.ParseInt(strings.TrimPrefix(f, "o"), 10, 64)
		if err != nil {
			continue
		}
		if !slices.Contains(subs, i) {
			subs = append(subs, i)
		}
		if n, err := strconv.ParseInt(c, 10, 64); err == nil && i >= first && f[0] != 'o' {
			counted += n
		}
	}
	slices.Sort(subs)
	slices.Reverse(subs)
	fmt.Fprintf(w, "  admitted  %d counted now\n", counted)
	for _, i := range subs {
		note := ""
		if i < first {
			note = ", no longer counted"
		}
		offered := ""
		if o, ok := h["o"+strconv.FormatInt(i, 10)]; ok {
			offered = ", offered " + o
		}
		admitted, ok := h[strconv.FormatInt(i, 10)]
		if !ok {
			admitted = "0"
		}
		fmt.Fprintf(w, "  %d: %s admitted%s (from %s%s)\n", i, admitted, offered, formatTime(i*g), note)
	}
	fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
}

// printBucket prints a bucket as the script writes it, and says
// so when v is not one.
func printBucket(w io.Writer, v string, ttl time.Duration, nowMicro int64) {
	b, ok := bucketvalue.Decode(v)
	if !ok {
		fmt.Fprintf(w, "  value     %s: a string of %d bytes but not a bucket: foreign data; reads as full, and the next decision that takes tokens replaces it\n", strconv.Quote(v), len(v))
		fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
		return
	}
	fmt.Fprintf(w, "  tokens    %d.%06d (%d micro-tokens, as of the stamp)\n", b.Tokens/microTokens, b.Tokens%microTokens, b.Tokens)
	age := time.Duration(nowMicro-b.Stamp) * time.Microsecond
	when := age.String() + " ago"
	if age < 0 {
		when = (-age).String() + " ahead of Redis TIME: the bucket refills nothing until then"
	}
	fmt.Fprintf(w, "  refilled  %s (stamp %d µs), %s\n", formatTime(b.Stamp), b.Stamp, when)
	if b.Version > 0 {
		fmt.Fprintf(w, "  version   %d, written with a capacity of %d tokens\n", b.Version, b.Capacity)
	}
	fmt.Fprintf(w, "  expires   %s\n", formatTTL(ttl))
	fmt.Fprintf(w, "  schema    2, a string of %d bytes\n", len(v))
}

// formatTime prints a time in µs since the epoch as UTC with microseconds.
func formatTime(us int64) string {
	return time.UnixMicro(us).UTC().Format("2006-01-02T15:04:05.000000Z")
}

// formatTTL describes a PTTL reply: go-redis returns -1 (no expiry) and -2
// (no key) as those many nanoseconds.
func formatTTL(ttl time.Duration) string {
	switch ttl {
	case -1:
		return "never (PTTL -1)"
	case -2:
		return "key gone (PTTL -2)"
	}
	return fmt.Sprintf("in %s (PTTL %d ms)", ttl, ttl.Milliseconds())
}

// reset deletes the bucket of key for each plan through RedisStore.Reset,
// and says which existed.
func reset(ctx context.Context, w io.Writer, c redis.UniversalClient, prefix, key string, plans []string) error {
	store := tollgate.NewRedisStore(c, tollgate.WithKeyPrefix(prefix))
	ps := make([]tollgate.Plan, len(plans)) // Reset needs only the names
	existed := make([]bool, len(plans))
	for i, name := range plans {
		ps[i] = tollgate.Plan{Name: name}
		n, err := c.Exists(ctx, store.Key(key, name)).Result()
		if err != nil {
			return fmt.Errorf("EXISTS of the bucket of plan %q: %w", name, err)
		}
		existed[i] = n == 1
	}
	if err := store.Reset(ctx, key, ps); err != nil {
		return fmt.Errorf("reset: %w", err)
	}
	deleted := 0
	for i, p := range ps {
		rk := strconv.Quote(store.Key(key, p.Name))
		kept, err := c.Exists(ctx, store.Key(key, p.Name)).Result()
		switch {
		case err != nil:
			return fmt.Errorf("EXISTS of the bucket of plan %q after the reset: %w", p.Name, err)
		case kept == 1: // Reset leaves a concurrency plan's permits
			fmt.Fprintf(w, "kept     %s (a concurrency plan's permits, their holders' until released)\n", rk)
		case existed[i]:
			deleted++
			fmt.Fprintf(w, "deleted  %s\n", rk)
		default:
			fmt.Fprintf(w, "absent   %s (already full)\n", rk)
		}
	}
	fmt.Fprintf(w, "deleted %d of %d buckets of key %s: they read as full in Redis now\n", deleted, len(ps), strconv.Quote(key))
	fmt.Fprintln(w, "running instances that denied the key keep denying it from their denial cache until the RetryAfter they gave")
	return nil
}
