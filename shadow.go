package tollgate

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
	for i := range min(len(plans), maxChain) {
		if plans[i].Shadow {
			m |= 1 << i
		}
	}
	return m
}
