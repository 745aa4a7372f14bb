package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestBackendsCosts decides per-rule costs (throttle.Costs) on every
// backend, over rules of three algorithms with hour-long periods, so
// nothing refills while it runs: one call charges each rule its own cost,
// a denial charges none, SettleCosts gives each rule back its own, and
// what it gives back serves the callers in the subject's line, booked at
// their costs when the line is served. On a cluster every key is in the
// subject's slot.
func TestBackendsCosts(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			rules := []throttle.Rule{
				{Name: "requests", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 10, Period: time.Hour, Burst: 10}},
				{Name: "input", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 1000, Period: time.Hour}, Precision: time.Minute},
				{Name: "output", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 500, Period: time.Hour, Burst: 500}},
			}
			opts := throttle.Options{Prefix: redistest.Prefix(t)}
			l, err := throttle.New(b.Client, opts, rules...)
			if err != nil {
				t.Fatal(err)
			}
			left := func(subject string) [3]int {
				t.Helper()
				var got [3]int
				for i, r := range rules {
					one, err := throttle.New(b.Client, opts, r)
					if err != nil {
						t.Fatal(err)
					}
					res, err := one.AllowN(ctx, subject, 0)
					if err != nil {
						t.Fatal(err)
					}
					got[i] = res.Remaining
				}
				return got
			}
			if res, err := l.AllowCosts(ctx, "k", throttle.Costs{1, 600, 200}); err != nil || !res.Allowed {
				t.Fatalf("allow: %+v, %v", res, err)
			}
			if res, err := l.AllowCosts(ctx, "k", throttle.Costs{1, 600, 0}); err != nil || res.Allowed || res.Rule != "input" {
				t.Fatalf("second: %+v, %v; want denied by input", res, err)
			}
			if got, want := left("k"), [3]int{9, 400, 300}; got != want {
				t.Fatalf("remaining %v, want %v", got, want)
			}
			r, err := l.ReserveCosts(ctx, "k", throttle.Costs{1, 300, 200})
			if err != nil {
				t.Fatal(err)
			}
			if err := r.SettleCosts(ctx, throttle.Costs{1, 100, 50}); err != nil {
				t.Fatal(err)
			}
			if got, want := left("k"), [3]int{8, 300, 250}; got != want {
				t.Fatalf("after settling 300 and 200 to 100 and 50: remaining %v, want %v", got, want)
			}

			// The line, and what a settle gives back: with 50 output tokens
			// left and a horizon of a minute, a caller wanting 200 joins
			// the line, charged nothing, and one behind it too; a serving
			// books nothing (the turn is 18 minutes away). A settle gives
			// 200 back, and the next serving books both at their costs.
			r, err = l.ReserveCosts(ctx, "k", throttle.Costs{1, 0, 200})
			if err != nil {
				t.Fatal(err)
			}
			line := func(id string, c throttle.Costs) throttle.Admission {
				t.Helper()
				a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "k", Costs: c, Caller: throttle.Caller{ID: id}, Horizon: time.Minute, Tolerance: time.Minute})
				if err != nil {
					t.Fatal(err)
				}
				return a
			}
			if a := line("a", throttle.Costs{1, 100, 200}); a.Status != throttle.Booked || !a.InLine {
				t.Fatalf("a: %+v; want in line", a)
			}
			if a := line("b", throttle.Costs{1, 10, 10}); a.Status != throttle.Booked || !a.InLine {
				t.Fatalf("b: %+v; want in line behind a", a)
			}
			s, err := l.ServeLine(ctx, "k", time.Minute, throttle.Limit{})
			if err != nil || len(s.Handed) != 0 || s.Waiting != 2 {
				t.Fatalf("serving: %+v, %v; want nobody handed, 2 waiting", s, err)
			}
			if got, want := left("k"), [3]int{7, 300, 50}; got != want {
				t.Fatalf("with two in line: remaining %v, want %v (nothing charged)", got, want)
			}
			if err := r.SettleCosts(ctx, throttle.Costs{1, 0, 0}); err != nil {
				t.Fatal(err)
			}
			s, err = l.ServeLine(ctx, "k", time.Minute, throttle.Limit{})
			if err != nil || len(s.Handed) != 2 || s.Waiting != 0 {
				t.Fatalf("serving after the settle: %+v, %v; want a and b handed", s, err)
			}
			if got, want := left("k"), [3]int{5, 190, 40}; got != want {
				t.Fatalf("after serving: remaining %v, want %v", got, want)
			}
		})
	}
}
