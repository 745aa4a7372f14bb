package throttle

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

func TestRuleValidate(t *testing.T) {
	ok := func(a Algorithm, l Limit) Rule { return Rule{Name: "api", Algorithm: a, Limit: l} }
	for _, tc := range []struct {
		name  string
		rule  Rule
		field string // "" = valid
		text  string // part of the message
	}{
		{"valid gcra", ok(GCRA, PerSecond(20)), "", ""},
		{"valid window without burst", ok(FixedWindow, Limit{Count: 5, Period: time.Second}), "", ""},
		{"empty name", Rule{Algorithm: GCRA, Limit: PerSecond(1)}, "name", "must not be empty"},
		{"unknown algorithm", Rule{Name: "api", Algorithm: 42, Limit: PerSecond(1)}, "algorithm", "Algorithm(42)"},
		{"zero algorithm", Rule{Name: "api", Limit: PerSecond(1)}, "algorithm", "is not one of"},
		{"count zero", ok(GCRA, Limit{Count: 0, Period: time.Second, Burst: 1}), "count", "at least 1"},
		{"count negative", ok(FixedWindow, Limit{Count: -3, Period: time.Second}), "count", "at least 1"},
		{"count huge", ok(TokenBucket, Limit{Count: MaxCount + 1, Period: time.Second, Burst: 1}), "count", "at most"},
		{"period zero", ok(GCRA, Limit{Count: 1, Burst: 1}), "period", "at least 1µs"},
		{"period negative", ok(SlidingLog, Limit{Count: 1, Period: -time.Second}), "period", "at least 1µs"},
		{"period sub-microsecond", ok(GCRA, Limit{Count: 1, Period: 999, Burst: 1}), "period", "at least 1µs"},
		{"period too long", ok(GCRA, Limit{Count: 1, Period: MaxPeriod + 1, Burst: 1}), "period", "at most"},
		{"burst zero", ok(GCRA, Limit{Count: 1, Period: time.Second}), "burst", "at least 1"},
		{"burst zero token bucket", ok(TokenBucket, Limit{Count: 1, Period: time.Second}), "burst", "at least 1"},
		{"burst huge", ok(TokenBucket, PerSecond(1).WithBurst(MaxCount+1)), "burst", "at most"},
		{"burst horizon overflows", ok(GCRA, PerDay(1).WithBurst(1_000_000)), "burst", "burst × period / count"},
		{"sliding log too large", ok(SlidingLog, PerHour(MaxLogCount+1)), "count", "use sliding_window"},
		{"precision negative", Rule{Name: "api", Algorithm: SlidingWindow, Limit: PerSecond(5), Precision: -time.Second}, "precision", "at least 1µs"},
		{"precision over period", Rule{Name: "api", Algorithm: SlidingWindow, Limit: PerSecond(5), Precision: 2 * time.Second}, "precision", "must not exceed the period"},
		{"too many buckets", Rule{Name: "api", Algorithm: SlidingWindow, Limit: PerHour(5), Precision: time.Millisecond}, "precision", "buckets"},
		{"precision ignored elsewhere", Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(5), Precision: -1}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.rule.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate: %v, want nil", err)
				}
				return
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("Validate: %v, want a *ConfigError", err)
			}
			if ce.Field != tc.field || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("Validate: %v (field %q), want field %q and text %q", err, ce.Field, tc.field, tc.text)
			}
			if tc.rule.Name != "" && (ce.Rule != tc.rule.Name || !strings.Contains(err.Error(), `rule "api"`)) {
				t.Fatalf("error %q does not name the rule", err)
			}
			if !strings.HasPrefix(err.Error(), "throttle: ") {
				t.Fatalf("error %q does not start with the package name", err)
			}
		})
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	rdb := newClientNoServer()
	good := Rule{Name: "a", Algorithm: GCRA, Limit: PerSecond(1)}
	for name, call := range map[string]func() error{
		"nil client":     func() error { _, err := New(nil, Options{}, good); return err },
		"no rules":       func() error { _, err := New(rdb, Options{}); return err },
		"duplicate rule": func() error { _, err := New(rdb, Options{}, good, good); return err },
		"brace prefix":   func() error { _, err := New(rdb, Options{Prefix: "a{b}:"}, good); return err },
		"negative wait":  func() error { _, err := New(rdb, Options{MaxWait: -time.Second}, good); return err },
		"invalid rule":   func() error { _, err := New(rdb, Options{}, good, Rule{Name: "b"}); return err },
	} {
		if err := call(); err == nil || !strings.HasPrefix(err.Error(), "throttle: ") {
			t.Errorf("%s: %v, want a throttle: error", name, err)
		}
	}
}

func TestFromRate(t *testing.T) {
	for _, tc := range []struct {
		rate float64
		want Limit
	}{
		{20, Limit{Count: 20, Period: time.Second, Burst: 3}},
		{2.5, Limit{Count: 25, Period: 10 * time.Second, Burst: 3}},
		{0.5, Limit{Count: 5, Period: 10 * time.Second, Burst: 3}},
		{1.0 / 3, Limit{Count: 333333333, Period: 1e9 * time.Second, Burst: 3}},
	} {
		got, err := FromRate(tc.rate, 3)
		if tc.rate == 1.0/3 {
			// Not a decimal: expressible only at 1e9 s, beyond MaxPeriod.
			if err == nil {
				t.Errorf("FromRate(1/3) = %v, want an error", got)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("FromRate(%v) = %v, %v; want %v", tc.rate, got, err, tc.want)
		}
	}
	for _, bad := range []float64{0, -1, math.NaN(), math.Inf(1), math.Inf(-1), 1e300, 1e-300} {
		if l, err := FromRate(bad, 1); err == nil {
			t.Errorf("FromRate(%v) = %v, want an error", bad, l)
		}
	}
	if _, err := FromRate(5, 0); err == nil {
		t.Errorf("FromRate(5, burst 0) succeeded, want a burst error")
	}
}

func TestLimitString(t *testing.T) {
	for _, tc := range []struct {
		l    Limit
		want string
	}{
		{PerSecond(20), "20 per 1s (burst 20)"},
		{PerMinute(5).WithBurst(1), "5 per 1m0s (burst 1)"},
		{Every(250 * time.Millisecond), "1 per 250ms (burst 1)"},
		{PerDay(20000), "20000 per 24h0m0s (burst 20000)"},
	} {
		if got := tc.l.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
	if got := PerSecond(20).Interval(); got != 50*time.Millisecond {
		t.Errorf("Interval() = %v, want 50ms", got)
	}
	r := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(20)}
	if got := r.String(); got != "api: gcra 20 per 1s (burst 20)" {
		t.Errorf("Rule.String() = %q", got)
	}
}

func TestParseAlgorithm(t *testing.T) {
	for in, want := range map[string]Algorithm{
		"fixed_window": FixedWindow, "sliding_log": SlidingLog, "sliding_window": SlidingWindow,
		"token_bucket": TokenBucket, "gcra": GCRA, "Leaky-Bucket": GCRA, " GCRA ": GCRA,
		"sliding-window-counter": SlidingWindow,
	} {
		if got, err := ParseAlgorithm(in); err != nil || got != want {
			t.Errorf("ParseAlgorithm(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for a := FixedWindow; a <= GCRA; a++ {
		if got, err := ParseAlgorithm(a.String()); err != nil || got != a {
			t.Errorf("round trip of %v: %v, %v", a, got, err)
		}
	}
	if _, err := ParseAlgorithm("leaky"); err == nil || !strings.Contains(err.Error(), "token_bucket") {
		t.Errorf("ParseAlgorithm(leaky): %v, want an error listing the algorithms", err)
	}
}
