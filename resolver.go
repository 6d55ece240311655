package tollgate

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// planResolver is the type of WithPlanResolver's function.
type planResolver = func(ctx context.Context, key string, p Plan) (Plan, error)

// SourceExempt means a plan resolver (WithPlanResolver) exempted the key from every plan asked
// (ErrExempt): the request was allowed without any bucket.
const SourceExempt Source = numSources

var (
	// ErrExempt is what a plan resolver (WithPlanResolver) returns, wrapped or not, to exempt a
	// key from a plan (see WithPlanResolver). A Limiter never returns it.
	ErrExempt = errors.New("tollgate: exempt")

	// ErrResolver means the plan resolver (WithPlanResolver) failed (returned an error other
	// than ErrExempt, or panicked), so the call decided nothing. It wraps
	// the resolver's error.
	ErrResolver = errors.New("tollgate: plan resolver failed")
)

// errPanicked is the cause of ErrResolver when the resolver panicked.
var errPanicked = errors.New("resolver panicked")

// resolveFor has the resolver choose key's plans. entry is the plan's
// when plans holds one plan, and plans, for a chain, a slice of the
// decision's own, which it overwrites. It returns ErrExempt if every plan
// is exempt, with plans as they were.
func (l *Limiter) resolveFor(ctx context.Context, t *planTable, key string, plans []Plan, entry *planEntry) ([]Plan, *planEntry, error) {
	// Plans are large: they go by pointer, and the resolver's answer is
	// written once, into p.
	var p Plan
	if entry != nil {
		if err := l.callResolver(ctx, key, &entry.one[0], &p); err != nil {
			return plans, nil, err
		}
		entry, err := l.variantOf(entry, &p)
		if err != nil {
			return nil, nil, err
		}
		return entry.one, entry, nil
	}
	kept := plans[:0:len(plans)]
	var last *planEntry // the entry of the last plan kept
	for i := range plans {
		name := plans[i].Name
		err := l.callResolver(ctx, key, &plans[i], &p)
		if errors.Is(err, ErrExempt) {
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		e, err := l.variantOf(t.byName[name], &p)
		if err != nil {
			return nil, nil, err
		}
		kept, last = append(kept, e.one[0]), e
	}
	switch len(kept) {
	case 0:
		return plans, nil, ErrExempt
	case 1:
		return last.one, last, nil
	}
	return kept, nil, nil
}

// callResolver calls the resolver for *in and writes its plan to *out,
// turning its errors and panics into the errors WithPlanResolver
// documents. in and out may be the same plan.
func (l *Limiter) callResolver(ctx context.Context, key string, in, out *Plan) (err error) {
	defer func() {
		if recover() != nil {
			err = fmt.Errorf("%w: %w", ErrResolver, errPanicked)
		}
	}()
	name := in.Name
	*out, err = l.resolver(ctx, resolverKey(ctx, key), *in)
	switch {
	case err == nil:
		if out.Name != name {
			return fmt.Errorf("%w: the resolver renamed plan %q", ErrInvalidPlan, name)
		}
		return nil
	case errors.Is(err, ErrExempt):
		return ErrExempt
	}
	return fmt.Errorf("%w: %w", ErrResolver, err)
}

// ResolveAs returns a context in which a decision on key gives the
// plan resolver (WithPlanResolver) the key as instead, the key the caller meant: the bucket
// stays key's. httplimit's Middleware and grpclimit's interceptors call it
// with the value their KeyFunc found, so that a resolver of API keys sees
// "key-gold" where the bucket is "header:X-Api-Key:key-gold", and keys of
// different kinds never share a bucket. Decisions on other keys under the
// context are not changed. It costs an allocation.
func ResolveAs(ctx context.Context, key, as string) context.Context {
	return &resolveAs{Context: ctx, key: key, as: as}
}

// resolveAs is ResolveAs's context: one allocation, where WithValue would
// box its value in a second.
type resolveAs struct {
	context.Context
	key, as string
}

// resolveAsKey is the context key under which a resolveAs finds itself.
type resolveAsKey struct{}

func (c *resolveAs) Value(k any) any {
	if k == (resolveAsKey{}) {
		return c
	}
	return c.Context.Value(k)
}

// resolverKey returns the key the resolver is given for a decision on key
// under ctx: the nearest ResolveAs's for key, or key itself.
func resolverKey(ctx context.Context, key string) string {
	for c, _ := ctx.Value(resolveAsKey{}).(*resolveAs); c != nil; c, _ = c.Context.Value(resolveAsKey{}).(*resolveAs) {
		if c.key == key {
			return c.as
		}
	}
	return key
}

// variantOf returns the entry of plan *p, of e's name, shadowed if the
// Limiter shadows every plan (which it sets in *p). A new plan is checked
// as it was given, before WithShadow shadowed it, as New checks its
// table: a Lease is valid on it, and ignored while it is shadowed.
func (l *Limiter) variantOf(e *planEntry, p *Plan) (*planEntry, error) {
	given := p.Shadow
	if l.shadowAll {
		if p.Concurrency {
			return nil, errShadowedPermits
		}
		p.Shadow = true
	}
	return e.variant(p, given)
}

// exemptResult is the decision on plans when the key is exempt from all.
func exemptResult(plans []Plan) Result {
	r := failOpenResult(plans)
	r.Source = SourceExempt
	return r
}

// entryOf returns the entry of the plan named name: the table's, or one
// AllowPlans made; nil if there is none.
func (l *Limiter) entryOf(t *planTable, name string) *planEntry {
	if e := t.byName[name]; e != nil {
		return e
	}
	return l.others.get(name)
}

// entryFor returns the entry of plan p, given to AllowPlans: a variant
// of the table's plan of its name, or of the plan of its name AllowPlans
// was first given, which p is if it is the first. A concurrency plan,
// which AllowPlans refuses, is never kept as the first: it would make
// every token bucket of its name the wrong kind.
func (l *Limiter) entryFor(t *planTable, p Plan) (*planEntry, error) {
	e := l.entryOf(t, p.Name)
	if e == nil {
		if err := p.validate(); err != nil {
			return nil, err
		}
		if p.Concurrency {
			return nil, fmt.Errorf("%w: %w", ErrInvalidPlan, errNoPermitPlan)
		}
		p.Shadow = p.Shadow || l.shadowAll
		e = l.others.add(p, l.stats.plan)
	}
	return l.variantOf(e, &p)
}

// maxOtherPlans bounds the plan names outside the table that a Limiter
// keeps entries and counters for: AllowPlans's names come from code, so
// they are few. Beyond the bound, plans decide alike but are checked on
// every call and counted nowhere.
const maxOtherPlans = 1024

// otherPlans are the entries of plans that AllowPlans was given and the
// table does not hold, by name. It is safe for concurrent use.
type otherPlans struct {
	mu     sync.RWMutex
	byName map[string]*planEntry
}

// get returns the entry of name, or nil.
func (o *otherPlans) get(name string) *planEntry {
	o.mu.RLock()
	defer o.mu.RUnlock()
	return o.byName[name]
}

// add returns the entry kept for p's name, new from p, which is valid, if
// there is none; counts gives a new entry's counters. Beyond the bound it
// returns an entry it does not keep, whose counts no Stats reads.
func (o *otherPlans) add(p Plan, counts func(name string) *planCount) *planEntry {
	o.mu.Lock()
	defer o.mu.Unlock()
	if kept := o.byName[p.Name]; kept != nil {
		return kept
	}
	if len(o.byName) >= maxOtherPlans {
		return newEntry(p, new(planCount))
	}
	if o.byName == nil {
		o.byName = make(map[string]*planEntry)
	}
	e := newEntry(p, counts(p.Name))
	o.byName[p.Name] = e
	return e
}
