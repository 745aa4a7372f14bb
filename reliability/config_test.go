package reliability

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestInvalidConfig builds a Limiter from every kind of invalid rule,
// limit and option. Each must fail in New, before any Redis call, with a
// *throttle.ConfigError whose Rule and Field name what is wrong and whose
// message says what is allowed.
func TestInvalidConfig(t *testing.T) {
	mini := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	ok := throttle.Rule{Name: "ok", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)}
	rule := func(name string, a throttle.Algorithm, l throttle.Limit) throttle.Rule {
		return throttle.Rule{Name: name, Algorithm: a, Limit: l}
	}
	sw := func(name string, period, precision time.Duration) throttle.Rule {
		return throttle.Rule{Name: name, Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 10, Period: period}, Precision: precision}
	}
	year := 365 * 24 * time.Hour

	cases := []struct {
		name    string
		opts    throttle.Options
		rules   []throttle.Rule
		rule    string // want ConfigError.Rule
		field   string // want ConfigError.Field
		allowed string // a phrase of the message that says what is allowed
	}{
		{"empty name", throttle.Options{}, []throttle.Rule{rule("", throttle.GCRA, throttle.PerSecond(1))}, "", "name", "must not be empty"},
		{"duplicate name", throttle.Options{}, []throttle.Rule{ok, ok}, "ok", "name", "must be unique"},
		{"algorithm empty", throttle.Options{}, []throttle.Rule{rule("a0", "", throttle.PerSecond(1))}, "a0", "algorithm", "fixed_window, sliding_log, sliding_window, token_bucket, gcra, concurrency or calendar"},
		{"algorithm unknown", throttle.Options{}, []throttle.Rule{rule("a99", "leaky", throttle.PerSecond(1))}, "a99", "algorithm", "is not one of"},
		{"subject too long", throttle.Options{}, []throttle.Rule{{Name: "subj", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1), Subject: strings.Repeat("x", 1025)}}, "subj", "subject", "at most 1024"},
		{"count zero", throttle.Options{}, []throttle.Rule{rule("c0", throttle.FixedWindow, throttle.Limit{Count: 0, Period: time.Second})}, "c0", "count", "at least 1"},
		{"count negative", throttle.Options{}, []throttle.Rule{rule("cneg", throttle.TokenBucket, throttle.Limit{Count: -5, Period: time.Second, Burst: 1})}, "cneg", "count", "at least 1"},
		{"count over MaxCount", throttle.Options{}, []throttle.Rule{rule("cbig", throttle.GCRA, throttle.Limit{Count: math.MaxInt, Period: time.Second, Burst: 1})}, "cbig", "count", "at most"},
		{"sliding log count", throttle.Options{}, []throttle.Rule{rule("log", throttle.SlidingLog, throttle.Limit{Count: 1_000_001, Period: time.Hour})}, "log", "count", "use sliding_window"},
		{"period zero", throttle.Options{}, []throttle.Rule{rule("p0", throttle.GCRA, throttle.Limit{Count: 1, Burst: 1})}, "p0", "period", "at least 1µs"},
		{"period negative", throttle.Options{}, []throttle.Rule{rule("pneg", throttle.SlidingLog, throttle.Limit{Count: 1, Period: -time.Second})}, "pneg", "period", "at least 1µs"},
		{"period below 1µs", throttle.Options{}, []throttle.Rule{rule("pns", throttle.FixedWindow, throttle.Limit{Count: 1, Period: 999})}, "pns", "period", "at least 1µs"},
		{"period over MaxPeriod", throttle.Options{}, []throttle.Rule{rule("plong", throttle.FixedWindow, throttle.Limit{Count: 1, Period: (10 * 365 * 24 * time.Hour) + time.Second})}, "plong", "period", "at most"},
		{"period max duration", throttle.Options{}, []throttle.Rule{rule("pmax", throttle.GCRA, throttle.Limit{Count: 1, Period: math.MaxInt64, Burst: 1})}, "pmax", "period", "at most"},
		{"burst zero (bucket)", throttle.Options{}, []throttle.Rule{rule("b0", throttle.TokenBucket, throttle.Limit{Count: 10, Period: time.Second})}, "b0", "burst", "at least 1"},
		{"burst negative (gcra)", throttle.Options{}, []throttle.Rule{rule("bneg", throttle.GCRA, throttle.Limit{Count: 10, Period: time.Second, Burst: -1})}, "bneg", "burst", "at least 1"},
		{"burst over MaxCount", throttle.Options{}, []throttle.Rule{rule("bbig", throttle.GCRA, throttle.Limit{Count: 10, Period: time.Second, Burst: math.MaxInt})}, "bbig", "burst", "at most"},
		{"burst horizon too long", throttle.Options{}, []throttle.Rule{rule("bhor", throttle.TokenBucket, throttle.Limit{Count: 1, Period: year, Burst: 11})}, "bhor", "burst", "burst × period / count must be at most"},
		{"precision below 1µs", throttle.Options{}, []throttle.Rule{sw("prec-ns", time.Second, 500)}, "prec-ns", "precision", "at least 1µs"},
		{"precision negative", throttle.Options{}, []throttle.Rule{sw("prec-neg", time.Second, -time.Millisecond)}, "prec-neg", "precision", "at least 1µs"},
		{"precision over period", throttle.Options{}, []throttle.Rule{sw("prec-big", time.Second, 2*time.Second)}, "prec-big", "precision", "must not exceed the period"},
		{"too many buckets", throttle.Options{}, []throttle.Rule{sw("prec-many", time.Hour, time.Millisecond)}, "prec-many", "precision", "buckets per period"},
		{"second rule invalid", throttle.Options{}, []throttle.Rule{ok, rule("second", throttle.FixedWindow, throttle.Limit{Count: 0, Period: time.Second})}, "second", "count", "at least 1"},
		{"prefix with {", throttle.Options{Prefix: "app{x"}, []throttle.Rule{ok}, "", "prefix", "must not contain '{' or '}'"},
		{"prefix with }", throttle.Options{Prefix: "app}:"}, []throttle.Rule{ok}, "", "prefix", "must not contain '{' or '}'"},
		{"negative MaxWait", throttle.Options{MaxWait: -time.Second}, []throttle.Rule{ok}, "", "max_wait", "must not be negative"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lim, err := throttle.New(rdb, c.opts, c.rules...)
			var ce *throttle.ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("New = %v, %v; want a *throttle.ConfigError", lim, err)
			}
			if ce.Rule != c.rule || ce.Field != c.field {
				t.Errorf("ConfigError{Rule: %q, Field: %q}; want {%q, %q}", ce.Rule, ce.Field, c.rule, c.field)
			}
			msg := err.Error()
			if !strings.HasPrefix(msg, "throttle: ") {
				t.Errorf("error %q does not start with the package name", msg)
			}
			if c.rule != "" && !strings.Contains(msg, `"`+c.rule+`"`) {
				t.Errorf("error %q does not name the rule %q", msg, c.rule)
			}
			if !strings.Contains(msg, c.field) || !strings.Contains(msg, c.allowed) {
				t.Errorf("error %q does not name the field %q and say %q", msg, c.field, c.allowed)
			}
			// Rule.Validate says the same for a single invalid rule.
			if len(c.rules) == 1 && c.field != "prefix" && c.field != "max_wait" {
				if err := c.rules[0].Validate(); err == nil || err.Error() != msg {
					t.Errorf("Rule.Validate = %v; want %q", err, msg)
				}
			}
		})
	}
	if mini.CommandCount() != 0 {
		t.Errorf("%d Redis commands while building invalid limiters; want none", mini.CommandCount())
	}

	t.Run("not ConfigError", func(t *testing.T) {
		// Errors that are not about one field are plain, and say what to do.
		for _, c := range []struct {
			name string
			err  func() error
			want string
		}{
			{"nil client", func() error { _, err := throttle.New(nil, throttle.Options{}, ok); return err }, "nil Redis client"},
			{"no rules", func() error { _, err := throttle.New(rdb, throttle.Options{}); return err }, "give at least one Rule"},
		} {
			err := c.err()
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "throttle: ") {
				t.Errorf("%s: %v; want an error starting \"throttle: \" that says %q", c.name, err, c.want)
			}
		}
	})
}
