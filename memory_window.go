package tollgate

// takeChain is decide for a chain with window or concurrency plans, and
// the Result is built in *r. It returns the time it decided at, µs.
func (m *MemoryStore) takeChain(r *Result, o *op) int64 {
	plans := o.plans
	// Fixed arrays keep a decision on up to four chained plans off the heap.
	var bbuf [4]TokenBucket
	var wbuf [4]*window
	var sbuf [4]planState
	buckets, windows, states := bbuf[:], wbuf[:], sbuf[:] // states of windows
	if len(plans) > len(bbuf) {
		buckets, windows, states = make([]TokenBucket, len(plans)), make([]*window, len(plans)), make([]planState, len(plans))
	}
	var u uint64
	suppressed := suppressedIn(plans)
	if suppressed {
		u = m.random()
	}
	d := outcome{plans: plans, buckets: buckets, windows: states, cost: o.cost()}

	lk, now := m.lock(o.key)
	e := lk.e
	d.now = now
	e.readChain(&d, windows)
	d.allowed, d.wd = chain(plans, buckets, windows, now, d.cost, u)
	taken := d.allowed && d.cost > 0
	if taken || suppressed && d.cost > 0 {
		if e == nil {
			e = lk.insert(m, o.key, len(plans), now)
		}
		e.writeChain(&d, windows)
		if taken && o.mode == modeAcquire {
			e.addPermits(o, now)
		}
	}
	e.describeChain(&d, windows)
	lk.unlock()
	r.describe(&d)
	return now
}

// readChain reads, for the decision d at d.now, the window of each window
// plan into windows, the bucket of each bucket plan into d.buckets, and
// the free permits of each concurrency plan, as tokens, into d.buckets,
// with what it reclaimed into d.windows. e may be nil: a key without
// state.
func (e *memEntry) readChain(d *outcome, windows []*window) {
	for i := range d.plans {
		switch p := &d.plans[i]; {
		case p.isWindow():
			windows[i] = e.window(p, d.now)
		case p.Concurrency:
			d.windows[i] = e.reclaim(p, d.now)
			d.buckets[i] = TokenBucket{Tokens: d.windows[i].remaining * microTokens, Stamp: d.now}
		default:
			d.buckets[i] = e.bucket(p, d.now)
		}
	}
}

// describeChain sets what the Result of the decision d tells of each
// plan, under the key's lock: the state of each window and concurrency
// plan into d.windows, and each bucket that nothing was taken from as
// stored. A decision that asks for tokens then brings back a bucket whose
// stamp is too far ahead, and a window ahead of now. e may be nil.
func (e *memEntry) describeChain(d *outcome, windows []*window) {
	now, cost := d.now, d.cost
	taken := d.allowed && cost > 0
	for i := range d.plans {
		switch p := &d.plans[i]; {
		case p.Concurrency:
			d.windows[i] = permitState(d.windows[i].remaining, d.windows[i].reclaimed, cost, taken)
		case p.isWindow():
			// Windows change in place: they are described under the lock.
			d.windows[i] = describeWindow(p, windows[i], e.waiting(p, windows[i], now), now, cost, d.allowed && d.wd&(1<<i) == 0)
			if cost > 0 {
				e.bringBackWindow(p, now)
			}
		case !taken || d.wd&(1<<i) != 0:
			// A denial, a read, or a shadowed plan that would deny leaves
			// the bucket as it was, and is described so, but a decision
			// that asks for tokens brings back a stamp too far ahead.
			d.buckets[i] = e.bucket(p, now)
			if cost > 0 {
				e.bringBack(p, d.buckets[i], now)
			}
		}
	}
}

// writeChain writes what the decision o on a chain with windows took:
// its cost from the bucket and into the window of each plan, if it was
// allowed, but for a shadowed plan that would deny; and what a suppressed
// window was offered. windows[i] is the window of plan i, which it
// replaces with the one it writes in.
func (e *memEntry) writeChain(o *outcome, windows []*window) {
	now, cost := o.now, o.cost
	for i := range o.plans {
		taken := o.allowed && cost > 0 && o.wd&(1<<i) == 0 // a shadowed plan that would deny takes nothing
		switch p := &o.plans[i]; {
		case p.Concurrency: // addPermits adds the permits
		case !p.isWindow():
			if taken { // describeChain brings back the stamp of a bucket not taken from
				o.buckets[i].Tokens -= cost * microTokens
				e.store(p, o.buckets[i])
			}
		case taken:
			windows[i] = e.storeWindow(p, now)
			windows[i].add(p, now, cost, cost)
		case p.Suppress != 0:
			windows[i] = e.storeWindow(p, now)
			windows[i].add(p, now, 0, cost)
		}
	}
}

// describeWindow returns what a Result reports of window w of plan p after
// a decision that wrote in it what the decision wrote: its counts before
// the decision are its counts now, less what it took. The wait for the
// tokens is read from wait, the window whose counts leave as p's do until
// a decision writes them (memEntry.waiting).
func describeWindow(p *Plan, w, wait *window, now, cost int64, allowed bool) planState {
	admitted, offered := w.counts(now)
	ready := now
	if allowed && cost > 0 {
		admitted -= cost
	} else {
		ready = wait.readyAt(p, now, asked(cost))
	}
	if p.Suppress != 0 && cost > 0 {
		offered -= cost
	}
	return windowState(p, windowCounts{admitted, offered, ready, w.resetAt(now)}, now, cost, allowed)
}

// waiting returns the window whose counts decide when plan p can take
// more tokens at now: w, p's window as read, unless the entry still keeps
// a window of the name of another shape, not ahead, which no decision
// carried into p's shape: w counts what it counts in now's sub-window,
// but until a write carries them they leave as that window says. e may
// be nil.
func (e *memEntry) waiting(p *Plan, w *window, now int64) *window {
	if b := e.find(p); b != nil && b.win != nil && !sameShape(&b.plan, p) && !b.win.ahead(now) {
		return b.win
	}
	return w
}
