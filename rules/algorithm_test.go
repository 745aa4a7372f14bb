package rules

import (
	"strings"
	"testing"

	"github.com/jobthrottle/jobthrottle/throttle"
)

func TestParseAlgorithm(t *testing.T) {
	for in, want := range map[string]throttle.Algorithm{
		"fixed_window": throttle.FixedWindow, "sliding_log": throttle.SlidingLog, "sliding_window": throttle.SlidingWindow,
		"token_bucket": throttle.TokenBucket, "gcra": throttle.GCRA, "Leaky-Bucket": throttle.GCRA, " GCRA ": throttle.GCRA,
		"sliding-window-counter": throttle.SlidingWindow,
	} {
		if got, err := ParseAlgorithm(in); err != nil || got != want {
			t.Errorf("ParseAlgorithm(%q) = %q, %v; want %q", in, got, err, want)
		}
		if err := (throttle.Rule{Name: "r", Algorithm: want, Limit: throttle.PerSecond(1)}).Validate(); err != nil {
			t.Errorf("%q is not an algorithm throttle knows: %v", want, err)
		}
	}
	if _, err := ParseAlgorithm("leaky"); err == nil || !strings.Contains(err.Error(), "token_bucket") {
		t.Errorf("ParseAlgorithm(leaky): %v, want an error listing the algorithms", err)
	}
}
