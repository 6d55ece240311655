package breaker

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
)

// memo is what an instance remembers of one key's shared state.
type memo struct {
	rkey        string
	openUntil   atomic.Int64 // on the instance's clock: refuse without Redis until then; 0 none
	closedUntil atomic.Int64 // with CacheClosedFor: grant without Redis until then; 0 none
	gen         atomic.Int64 // the generation Redis last reported
	state       atomic.Int64 // the state Redis last reported
	held        atomic.Bool  // Redis last reported it forced open

	mu      sync.Mutex
	pending batch // outcomes of locally granted calls, for the next round trip
	pendGen int64
}

// learn updates m from a reply to a call sent at start, and logs and counts
// what the reply says happened.
func (b *Shared) learn(key string, m *memo, r reply, in input, start int64) {
	if m != nil {
		m.gen.Store(r.gen)
		m.state.Store(r.state)
		m.held.Store(r.held == 1)
		// Deadlines count from when the call was sent, which is before
		// Redis read its clock: the instance never refuses longer than
		// Redis would.
		switch {
		case r.state == stateOpen:
			m.openUntil.Store(start + r.wait*1000)
			m.closedUntil.Store(0)
		case r.state == stateClosed && b.set.CacheClosedFor > 0 && in.op == opAcquire:
			m.openUntil.Store(0)
			m.mu.Lock()
			if m.pendGen != r.gen {
				m.pending, m.pendGen = batch{}, r.gen
			}
			m.mu.Unlock()
			m.closedUntil.Store(start + int64(b.set.CacheClosedFor))
		case r.state == stateClosed:
			m.openUntil.Store(0) // a closed cache stays as its acquire set it
		default:
			m.openUntil.Store(0)
			m.closedUntil.Store(0)
		}
	}
	if r.foreign == 1 && in.op != opRead {
		b.stats.foreign.Add(1)
		b.log.Warn("tollgate/breaker: replaced a foreign value at a breaker's key")
	}
	if r.from != 0 {
		b.transitioned(key, r, in.op, false)
	}
}

// transitioned counts and logs one state change that this instance's call
// made; every change of a shared state happens in exactly one script call,
// so the fleet logs each once. local marks a Fallback breaker's change.
func (b *Shared) transitioned(key string, r reply, op int, local bool) {
	from, to := State(r.from-1), State(r.state)
	b.stats.entered[to].Add(1)
	if from == Closed && to == Open && op < opForceOpen {
		b.stats.trips.Add(1)
	}
	level, msg := slog.LevelInfo, "tollgate/breaker: "+from.String()+" → "+to.String()
	switch {
	case op == opForceOpen:
		msg = "tollgate/breaker: forced open"
	case op == opForceClosed:
		msg = "tollgate/breaker: forced closed"
	case op == opReset:
		msg = "tollgate/breaker: reset"
	case to == Open:
		level = slog.LevelWarn
	}
	attrs := []slog.Attr{slog.String("from", from.String()), slog.String("to", to.String()),
		slog.Int64("generation", r.gen), slog.Int64("trips", r.trips), slog.Bool("local", local)}
	if b.logKeys {
		attrs = append(attrs, slog.String("key", key))
	}
	b.log.LogAttrs(context.Background(), level, msg, attrs...)
}

// memo returns key's memo, or nil.
func (b *Shared) memo(key string) *memo {
	b.mu.RLock()
	m := b.memos[key]
	b.mu.RUnlock()
	return m
}

// newMemo returns key's memo, creating it.
func (b *Shared) newMemo(key, rkey string) *memo {
	b.mu.Lock()
	defer b.mu.Unlock()
	if m := b.memos[key]; m != nil {
		return m
	}
	if len(b.memos) >= maxKeys {
		b.memos = map[string]*memo{}
	}
	m := &memo{rkey: rkey}
	b.memos[key] = m
	return m
}

// pend adds bt, outcomes of calls of generation gen, to those m holds for
// its next round trip, dropping any of an older generation first.
func (m *memo) pend(gen int64, bt batch) {
	if bt.calls == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.pendGen != gen {
		m.pending, m.pendGen = batch{}, gen
	}
	m.pending = m.pending.add(bt)
}

// takePending returns the outcomes m holds for its next round trip, and
// their generation, and holds none after.
func (m *memo) takePending() (batch, int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	bt := m.pending
	m.pending = batch{}
	return bt, m.pendGen
}

// returnPending gives back bt, outcomes of generation gen that
// takePending returned for a round trip that never ran the script, unless
// outcomes of another generation came since.
func (m *memo) returnPending(bt batch, gen int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.pendGen == gen {
		m.pending = bt.add(m.pending)
	}
}
