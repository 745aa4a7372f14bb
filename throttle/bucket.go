package throttle

import "fmt"

// validateBurst checks the burst of a bucket rule (TokenBucket, GCRA).
func validateBurst(r Rule) error {
	l := r.Limit
	bad := func(reason string) error {
		return &ConfigError{Rule: r.Name, Field: "burst", Reason: fmt.Sprintf("%v %s", l.Burst, reason)}
	}
	switch {
	case l.Burst < 1:
		return bad("must be at least 1: the most permits the bucket admits at one instant")
	case l.Burst > maxCount:
		return bad(fmt.Sprintf("must be at most %d", maxCount))
	case float64(l.Burst)*float64(l.Period)/float64(l.Count) > float64(maxPeriod):
		return bad(fmt.Sprintf("burst × period / count must be at most %v", maxPeriod))
	}
	return nil
}

// lowestTerms reduces a bucket rule's count and period (µs) by their
// greatest common divisor before they reach the script. The interval T =
// period / count is unchanged; bucket.lua keeps every time as a whole
// number of microseconds plus a remainder in units of 1/count µs, so the
// smaller count keeps those remainders, and the products it forms, small.
func lowestTerms(count, period int64) (int64, int64) {
	a, b := count, period
	for b != 0 {
		a, b = b, a%b
	}
	if a <= 1 {
		return count, period
	}
	return count / a, period / a
}
