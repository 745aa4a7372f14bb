package admission

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

func TestDescribeLimit(t *testing.T) {
	for _, tc := range []struct {
		rule throttle.Rule
		want string
	}{
		{throttle.Rule{Name: "a", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)}, "gcra 5 per 1s (burst 1)"},
		{throttle.Rule{Name: "a", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 100, Period: time.Minute, Burst: 10}}, "token_bucket 100 per 1m0s (burst 10)"},
		{throttle.Rule{Name: "a", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 7, Period: time.Hour, Burst: 3}}, "fixed_window 7 per 1h0m0s"},
		{throttle.Rule{Name: "a", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 100, Period: time.Minute}}, "sliding_window 100 per 1m0s (precision 3s)"},
		{throttle.Rule{Name: "a", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 100, Period: time.Minute}, Precision: time.Second}, "sliding_window 100 per 1m0s (precision 1s)"},
		{throttle.Rule{Name: "a", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 5, Period: 30 * time.Second}}, "concurrency 5 at once (lease 30s)"},
		// A calendar quota: as a rules file gives it, and as a limiter's Rules report it (Period filled in).
		{throttle.Rule{Name: "a", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: 1000}, Calendar: throttle.Daily(time.UTC)}, "calendar 1000 per day@UTC"},
		{throttle.Rule{Name: "a", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: 1000, Period: 24 * time.Hour, Burst: 1000}, Calendar: throttle.Daily(time.UTC)}, "calendar 1000 per day@UTC"},
	} {
		if got := DescribeLimit(tc.rule); got != tc.want {
			t.Errorf("DescribeLimit(%+v) = %q, want %q", tc.rule, got, tc.want)
		}
	}
}

// Workers publish; a producer's rules are checked against what they
// published: the same limit passes, another is refused naming the rule
// and both limits, and a rule no worker published passes (its limit is
// the only one there is).
func TestCheckLimits(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	slow := throttle.Rule{Name: "partner", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)}
	budget := throttle.Rule{Name: "budget", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 1000, Period: time.Hour}}
	if err := PublishLimits(ctx, rdb, "p:", []throttle.Rule{slow, budget}); err != nil {
		t.Fatal(err)
	}
	if ttl := m.TTL(LimitsKey("p:")); ttl <= 0 || ttl > limitsTTL {
		t.Errorf("TTL of %s = %v, want (0, %v]", LimitsKey("p:"), ttl, limitsTTL)
	}

	if err := CheckLimits(ctx, rdb, "p:", []throttle.Rule{slow, budget}); err != nil {
		t.Errorf("the workers' own limits: %v, want nil", err)
	}
	other := throttle.Rule{Name: "unpublished", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(50)}
	if err := CheckLimits(ctx, rdb, "p:", []throttle.Rule{other}); err != nil {
		t.Errorf("a rule no worker published: %v, want nil", err)
	}
	if err := CheckLimits(ctx, rdb, "q:", []throttle.Rule{{Name: "partner", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20)}}); err != nil {
		t.Errorf("another prefix: %v, want nil", err)
	}

	fast := slow
	fast.Limit = throttle.PerSecond(20).WithBurst(5)
	err := CheckLimits(ctx, rdb, "p:", []throttle.Rule{budget, fast})
	var mm *LimitMismatchError
	if !errors.As(err, &mm) {
		t.Fatalf("a faster producer: %v, want a *LimitMismatchError", err)
	}
	if mm.Rule != "partner" || mm.Workers != "gcra 5 per 1s (burst 1)" || mm.Ours != "gcra 20 per 1s (burst 5)" {
		t.Errorf("got %+v; want rule partner, workers gcra 5 per 1s (burst 1), ours gcra 20 per 1s (burst 5)", *mm)
	}
	for _, part := range []string{`rule "partner"`, "gcra 5 per 1s (burst 1)", "gcra 20 per 1s (burst 5)", "rules file"} {
		if !strings.Contains(err.Error(), part) {
			t.Errorf("error %q does not say %q", err, part)
		}
	}

	// A reload publishes the new limit: the faster producer now matches.
	if err := PublishLimits(ctx, rdb, "p:", []throttle.Rule{fast}); err != nil {
		t.Fatal(err)
	}
	if err := CheckLimits(ctx, rdb, "p:", []throttle.Rule{fast, budget}); err != nil {
		t.Errorf("after the workers published the faster limit: %v, want nil", err)
	}

	m.SetError("LOADING")
	if err := CheckLimits(ctx, rdb, "p:", []throttle.Rule{fast}); err == nil || !strings.HasPrefix(err.Error(), "admission: reading the workers' limits") {
		t.Errorf("Redis failing: %v, want the read error", err)
	}
}
