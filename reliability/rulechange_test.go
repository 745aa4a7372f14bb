package reliability

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestRuleChangeOnLiveKeys edits a rule the way an operator edits a rules
// file and restarts the workers: same prefix, same rule name, keys still
// live. (FuzzLimitValidate found the first case.)
//
// Changed limits of one algorithm must give sane answers at once: for the
// sliding window, a denial's RetryAfter never longer than the new rule's own
// horizon (period plus precision) and never 0 or negative; for the buckets,
// a backlog booked under a huge rule is, under a tiny one, a very long but
// positive wait (not an overflow). A queue centuries deep (Waits without
// deadline on a 1-per-10-years rule) keeps positive, growing delays.
//
// A changed algorithm finds a key of another type. That fails closed with
// a clear error (ErrRedis wrapping WRONGTYPE) until the old key's TTL ends;
// RELIABILITY.md tells operators to rename a rule whose algorithm changes.
func TestRuleChangeOnLiveKeys(t *testing.T) {
	ctx := context.Background()
	configs := []throttle.Limit{
		{Count: 3, Period: time.Second},
		{Count: 5, Period: time.Hour},
		{Count: 3, Period: 100 * time.Hour},
		{Count: 2, Period: 20 * time.Millisecond},
		{Count: 1, Period: (10 * 365 * 24 * time.Hour)},
		{Count: 4, Period: time.Minute},
	}
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			prefix := redistest.Prefix(t)
			t.Run("sliding_window limits", func(t *testing.T) {
				for i, l := range configs {
					for _, precision := range []time.Duration{0, l.Period / 3} {
						rule := throttle.Rule{Name: "api", Algorithm: throttle.SlidingWindow, Limit: l, Precision: precision}
						lim, err := throttle.New(b.Client, throttle.Options{Prefix: prefix}, rule)
						if err != nil {
							t.Fatal(err)
						}
						horizon := l.Period + max(precision, l.Period/20) + time.Millisecond
						for range l.Count + 1 {
							res, err := lim.Allow(ctx, "tenant")
							if err != nil {
								t.Fatalf("config %d (%v): %v", i, rule, err)
							}
							if !res.Allowed && (res.RetryAfter <= 0 || res.RetryAfter > horizon) {
								t.Errorf("config %d (%v), after earlier configs: denied with RetryAfter %v; want within (0, %v]",
									i, rule, res.RetryAfter, horizon)
							}
						}
					}
				}
			})
			t.Run("bucket limits", func(t *testing.T) {
				// A huge rule books a huge backlog; then the rule becomes
				// tiny, so the backlog is centuries long at the new rate.
				huge, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
					throttle.Rule{Name: "tb", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 1 << 40, Period: time.Second, Burst: 1 << 40}},
					throttle.Rule{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1 << 40, Period: time.Second, Burst: 1 << 40}})
				if err != nil {
					t.Fatal(err)
				}
				for range 3 {
					if _, err := huge.ReserveN(ctx, "tenant", 1<<40); err != nil {
						t.Fatal(err)
					}
				}
				tiny, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
					throttle.Rule{Name: "tb", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 1, Period: (10 * 365 * 24 * time.Hour), Burst: 1}},
					throttle.Rule{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: (10 * 365 * 24 * time.Hour), Burst: 1}})
				if err != nil {
					t.Fatal(err)
				}
				res, err := tiny.Allow(ctx, "tenant")
				if err != nil || res.Allowed || res.RetryAfter <= 0 {
					t.Errorf("Allow after the rule shrank = %+v, %v; want denied with a positive RetryAfter", res, err)
				}
				r, err := tiny.ReserveN(ctx, "tenant", 1)
				if err != nil || r.Delay() <= 0 {
					t.Errorf("Reserve after the rule shrank: %v; want a (very long) positive delay", err)
				}
			})
			t.Run("deep queue", func(t *testing.T) {
				// 1 per 10 years, Waits without a deadline: the 30th is
				// booked 290 years ahead, past what a time.Duration holds.
				// Every delay must stay positive and growing, never wrap
				// around to "now" (which would admit at once).
				for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.GCRA} {
					lim, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
						throttle.Rule{Name: "deep-" + string(a), Algorithm: a, Limit: throttle.Limit{Count: 1, Period: (10 * 365 * 24 * time.Hour), Burst: 1}})
					if err != nil {
						t.Fatal(err)
					}
					// Delay counts down from now (as x/time/rate's), so
					// the time to act is what must never move earlier.
					var last time.Time
					for i := range 40 {
						r, err := lim.ReserveN(ctx, "tenant", 1)
						if err != nil {
							t.Fatalf("%v: reservation %d: %v", a, i, err)
						}
						if i > 0 && (r.Delay() <= 0 || time.Now().Add(r.Delay()).Before(last)) {
							t.Fatalf("%v: reservation %d delay %v, time to act %v after %v; want positive and never earlier", a, i, r.Delay(), time.Now().Add(r.Delay()), last)
						}
						last = time.Now().Add(r.Delay())
					}
				}
			})
			t.Run("algorithm", func(t *testing.T) {
				old, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
					throttle.Rule{Name: "moved", Algorithm: throttle.FixedWindow, Limit: throttle.PerSecond(5)})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := old.Allow(ctx, "tenant"); err != nil {
					t.Fatal(err)
				}
				changed, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
					throttle.Rule{Name: "moved", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5)})
				if err != nil {
					t.Fatal(err)
				}
				_, err = changed.Allow(ctx, "tenant")
				if err == nil {
					return // a future key layout that keeps algorithms apart
				}
				if !errors.Is(err, throttle.ErrRedis) || !strings.Contains(err.Error(), "WRONGTYPE") {
					t.Errorf("Allow after changing the algorithm = %v; want ErrRedis wrapping WRONGTYPE", err)
				}
				t.Logf("changing a rule's algorithm under the same name: %v (until the old key expires)", err)
			})
		})
	}
}
