package rules

import (
	"fmt"
	"strings"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// ParseAlgorithm reads an algorithm as rules files and command lines spell
// it: its name (throttle.Algorithm), or leaky_bucket for gcra and
// sliding_window_counter for sliding_window, in any case, with dashes or
// underscores.
func ParseAlgorithm(s string) (throttle.Algorithm, error) {
	norm := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(s)), "-", "_")
	switch norm {
	case "leaky_bucket":
		return throttle.GCRA, nil
	case "sliding_window_counter":
		return throttle.SlidingWindow, nil
	}
	switch a := throttle.Algorithm(norm); a {
	case throttle.FixedWindow, throttle.SlidingLog, throttle.SlidingWindow, throttle.TokenBucket, throttle.GCRA:
		return a, nil
	}
	return "", fmt.Errorf("unknown algorithm %q: use fixed_window, sliding_log, sliding_window, token_bucket or gcra (leaky_bucket)", s)
}
