package throttle

import (
	"fmt"
	"time"
)

// SlidingWindow: lua/slidingwindow.lua counts permits in buckets of
// Rule.Precision, which the script gets as its fourth value.
var _ = register(SlidingWindow, &algorithm{
	rank:     3,
	files:    []string{"slidingwindow.lua"},
	validate: validatePrecision,
	extra:    func(r Rule) int64 { return r.precision().Microseconds() },
})

// precision returns the effective bucket width of a SlidingWindow rule.
func (r Rule) precision() time.Duration {
	if r.Precision != 0 {
		return r.Precision
	}
	return max(r.Limit.Period/20, time.Microsecond)
}

// validatePrecision checks a sliding window's bucket width against its
// period.
func validatePrecision(r Rule) error {
	p := r.precision()
	switch {
	case p < time.Microsecond:
		return &ConfigError{Rule: r.Name, Field: "precision", Reason: fmt.Sprintf("%v must be at least 1µs", p)}
	case p > r.Limit.Period:
		return &ConfigError{Rule: r.Name, Field: "precision", Reason: fmt.Sprintf("%v must not exceed the period %v", p, r.Limit.Period)}
	case r.Limit.Period/p > maxBuckets:
		return &ConfigError{Rule: r.Name, Field: "precision", Reason: fmt.Sprintf("%v gives more than %d buckets per period %v", p, maxBuckets, r.Limit.Period)}
	}
	return nil
}
