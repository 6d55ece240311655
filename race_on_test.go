//go:build race

package tollgate

// raceEnabled reports whether the race detector is on: it makes sync.Pool
// drop a quarter of what is put back, so allocation counts that rely on a
// pool do not hold under it.
const raceEnabled = true
