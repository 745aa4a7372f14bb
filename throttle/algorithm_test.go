package throttle

import (
	"errors"
	"slices"
	"testing"
	"time"
)

// TestAlgorithmFacts: Algorithms lists every algorithm in the documented
// order, and Bucket names the two that keep bucket.lua's state.
func TestAlgorithmFacts(t *testing.T) {
	want := []Algorithm{FixedWindow, SlidingLog, SlidingWindow, TokenBucket, GCRA, Concurrency, CalendarWindow}
	if got := Algorithms(); !slices.Equal(got, want) {
		t.Errorf("Algorithms() = %v; want %v", got, want)
	}
	for _, a := range want {
		if got, want := a.Bucket(), a == TokenBucket || a == GCRA; got != want {
			t.Errorf("%s.Bucket() = %v; want %v", a, got, want)
		}
	}
	if Algorithm("leaky").Bucket() {
		t.Error(`an unknown algorithm is a bucket`)
	}
}

// TestCheckShare: a share limit is a GCRA limit whose zero Burst is
// its Count, over rules of the bucket algorithms only.
func TestCheckShare(t *testing.T) {
	gcra := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(50)}
	sl, err := Limit{Count: 10, Period: time.Second}.CheckShare(gcra, Rule{Name: "tb", Algorithm: TokenBucket, Limit: PerSecond(5)})
	if err != nil || sl != PerSecond(10) {
		t.Errorf("a valid share limit: %+v, %v; want %+v", sl, err, PerSecond(10))
	}
	for _, tc := range []struct {
		name        string
		sl          Limit
		rules       []Rule
		rule, field string
	}{
		{"no count", Limit{Period: time.Second}, nil, "share_limit", "count"},
		{"no period", Limit{Count: 10}, nil, "share_limit", "period"},
		{"negative burst", Limit{Count: 10, Period: time.Second, Burst: -1}, nil, "share_limit", "burst"},
		{"window", PerSecond(10), []Rule{gcra, {Name: "w", Algorithm: SlidingWindow, Limit: PerSecond(5)}}, "w", "algorithm"},
		{"concurrency", PerSecond(10), []Rule{{Name: "c", Algorithm: Concurrency, Limit: Limit{Count: 2, Period: time.Second}}}, "c", "algorithm"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.sl.CheckShare(tc.rules...)
			var ce *ConfigError
			if !errors.As(err, &ce) || ce.Rule != tc.rule || ce.Field != tc.field {
				t.Errorf("CheckShare: %v; want a *ConfigError of rule %q, field %q", err, tc.rule, tc.field)
			}
		})
	}
}
