package throttle

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
