package throttle

import (
	"errors"
	"slices"
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
		{"unknown algorithm", Rule{Name: "api", Algorithm: "leaky", Limit: PerSecond(1)}, "algorithm", `"leaky" is not one of`},
		{"zero algorithm", Rule{Name: "api", Limit: PerSecond(1)}, "algorithm", "is not one of"},
		{"count zero", ok(GCRA, Limit{Count: 0, Period: time.Second, Burst: 1}), "count", "at least 1"},
		{"count negative", ok(FixedWindow, Limit{Count: -3, Period: time.Second}), "count", "at least 1"},
		{"count huge", ok(TokenBucket, Limit{Count: maxCount + 1, Period: time.Second, Burst: 1}), "count", "at most"},
		{"period zero", ok(GCRA, Limit{Count: 1, Burst: 1}), "period", "at least 1µs"},
		{"period negative", ok(SlidingLog, Limit{Count: 1, Period: -time.Second}), "period", "at least 1µs"},
		{"period sub-microsecond", ok(GCRA, Limit{Count: 1, Period: 999, Burst: 1}), "period", "at least 1µs"},
		{"period too long", ok(GCRA, Limit{Count: 1, Period: maxPeriod + 1, Burst: 1}), "period", "at most"},
		{"burst zero", ok(GCRA, Limit{Count: 1, Period: time.Second}), "burst", "at least 1"},
		{"burst zero token bucket", ok(TokenBucket, Limit{Count: 1, Period: time.Second}), "burst", "at least 1"},
		{"burst huge", ok(TokenBucket, PerSecond(1).WithBurst(maxCount+1)), "burst", "at most"},
		{"burst horizon overflows", ok(GCRA, Limit{Count: 1, Period: 24 * time.Hour, Burst: 1}.WithBurst(1_000_000)), "burst", "burst × period / count"},
		{"sliding log too large", ok(SlidingLog, Limit{Count: maxLogCount + 1, Period: time.Hour, Burst: maxLogCount + 1}), "count", "use sliding_window"},
		{"precision negative", Rule{Name: "api", Algorithm: SlidingWindow, Limit: PerSecond(5), Precision: -time.Second}, "precision", "at least 1µs"},
		{"precision over period", Rule{Name: "api", Algorithm: SlidingWindow, Limit: PerSecond(5), Precision: 2 * time.Second}, "precision", "must not exceed the period"},
		{"too many buckets", Rule{Name: "api", Algorithm: SlidingWindow, Limit: Limit{Count: 5, Period: time.Hour, Burst: 5}, Precision: time.Millisecond}, "precision", "buckets"},
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

func TestLimitDescribe(t *testing.T) {
	for _, tc := range []struct {
		l    Limit
		want string
	}{
		{PerSecond(20), "20 per 1s (burst 20)"},
		{Limit{Count: 5, Period: time.Minute, Burst: 5}.WithBurst(1), "5 per 1m0s (burst 1)"},
		{Limit{Count: 1, Period: 250 * time.Millisecond, Burst: 1}, "1 per 250ms (burst 1)"},
		{Limit{Count: 20000, Period: 24 * time.Hour, Burst: 20000}, "20000 per 24h0m0s (burst 20000)"},
	} {
		if got := tc.l.describe(); got != tc.want {
			t.Errorf("describe() = %q, want %q", got, tc.want)
		}
	}
	if got := PerSecond(20).interval(); got != 50*time.Millisecond {
		t.Errorf("interval() = %v, want 50ms", got)
	}
	r := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(20)}
	if got := r.describe(); got != "api: gcra 20 per 1s (burst 20)" {
		t.Errorf("Rule.describe() = %q", got)
	}
}

// An algorithm is its name: Validate refuses any other spelling, naming
// the algorithms.
func TestAlgorithmNames(t *testing.T) {
	want := []Algorithm{FixedWindow, SlidingLog, SlidingWindow, TokenBucket, GCRA, Concurrency, CalendarWindow}
	if got := registered(); !slices.Equal(got, want) {
		t.Fatalf("registered() = %v, want %v", got, want)
	}
	for _, a := range want {
		if err := sampleRule("api", a, PerSecond(5)).Validate(); err != nil {
			t.Errorf("Validate with %q: %v", a, err)
		}
	}
	for _, bad := range []Algorithm{"leaky", "GCRA", "leaky_bucket", ""} {
		err := Rule{Name: "api", Algorithm: bad, Limit: PerSecond(1)}.Validate()
		if err == nil || !strings.Contains(err.Error(), "fixed_window, sliding_log, sliding_window, token_bucket, gcra, concurrency or calendar") {
			t.Errorf("Validate with %q: %v, want an error listing the algorithms", bad, err)
		}
	}
}
