package redistest

import (
	"slices"
	"time"
)

// MaxInWindow returns the most of times that fall in any half-open window
// of length d: the figure a limit of so many per d bounds.
func MaxInWindow(times []time.Time, d time.Duration) int {
	s := slices.Clone(times)
	slices.SortFunc(s, time.Time.Compare)
	best, j := 0, 0
	for i := range s {
		for s[i].Sub(s[j]) >= d {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}
