package tollgate

import "fmt"

// maxShadowIndex bounds where a shadowed plan may sit in a chain: the
// script reports would-be denials as bits of one whole number, which a
// Lua number holds exactly up to 2^53, next to the allowed bit.
const maxShadowIndex = 52

// checkShadow rejects a chain whose shadowed plans the script could not
// report.
func checkShadow(plans []Plan) error {
	for i := maxShadowIndex; i < len(plans); i++ {
		if plans[i].Shadow {
			return fmt.Errorf("%w: a shadowed plan may be at most %dth in a chain, got %d", ErrInvalidPlan, maxShadowIndex, i+1)
		}
	}
	return nil
}

// capacityArg is plan p's capacity as the script takes it: negative for a
// shadowed plan (see scripts/limit.lua).
func capacityArg(p *Plan) int64 {
	if p.Shadow {
		return -p.Capacity
	}
	return p.Capacity
}

// shadowMask returns the bits that a would-be denial of plans may set:
// bit i for shadowed plan i.
func shadowMask(plans []Plan) uint64 {
	var m uint64
	for i := range min(len(plans), maxShadowIndex) {
		if plans[i].Shadow {
			m |= 1 << i
		}
	}
	return m
}
