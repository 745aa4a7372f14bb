package throttle

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// eachAlgorithm runs f in a virtual bubble for each of the five rate
// algorithms, with a limiter of one rule "r", 5 per second (burst 5).
func eachAlgorithm(t *testing.T, f func(t *testing.T, l *Limiter, m *miniredis.Miniredis)) {
	for _, a := range rateAlgorithms() {
		t.Run(string(a), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				f(t, mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: a, Limit: PerSecond(5)}), m)
			})
		})
	}
}

// n = 0 is a state read for every algorithm (issue 11.3): AllowN(0)
// reports Remaining and ResetAfter and charges nothing; WaitN(0) returns
// at once; ReserveN(0) is granted with no delay and has nothing to cancel.
func TestZeroPermitsReadsTheState(t *testing.T) {
	eachAlgorithm(t, func(t *testing.T, l *Limiter, m *miniredis.Miniredis) {
		ctx := context.Background()
		time.Sleep(100 * ms) // inside the fixed window [0, 1s)
		if res := allow(t, l, "s", 0); !res.Allowed || res.Remaining != 5 {
			t.Fatalf("AllowN(0) on a fresh subject: %+v, want allowed, 5 left", res)
		}
		if m.Exists("jobthrottle:{s}:r") {
			t.Fatal("AllowN(0) wrote the rule's key")
		}
		allow(t, l, "s", 3)
		before := fmt.Sprint(m.Dump())
		res := allow(t, l, "s", 0)
		if !res.Allowed || res.Remaining != 2 || res.ResetAfter <= 0 || res.RetryAfter != 0 {
			t.Fatalf("AllowN(0) after 3: %+v, want allowed, 2 left, a reset time", res)
		}
		if err := l.WaitN(ctx, "s", 0); err != nil || at() != 100*ms {
			t.Fatalf("WaitN(0) = %v at %v, want nil at once", err, at())
		}
		if l.rules[0].Algorithm.bucket() {
			r, err := l.ReserveN(ctx, "s", 0)
			if err != nil || r.Delay() != 0 {
				t.Fatalf("ReserveN(0) = %v, %v; want granted now", r, err)
			}
			if err := r.Cancel(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if after := fmt.Sprint(m.Dump()); after != before {
			t.Fatalf("n = 0 changed the state:\nbefore %s\nafter  %s", before, after)
		}
		if res := allow(t, l, "s", 2); !res.Allowed || res.Remaining != 0 {
			t.Fatalf("AllowN(2) after the reads: %+v, want allowed, 0 left", res)
		}
	})
}

// While reservations hold a bucket in debt, a request of 0 would wait:
// AllowN(0) says so and when, and ReserveN(0) is granted for then, as
// x/time/rate's ReserveN(0) is.
func TestZeroPermitsInDebt(t *testing.T) {
	eachBucket(t, func(t *testing.T, l *Limiter) {
		ctx := context.Background()
		for range 3 { // slots 0, 100ms, 200ms: in debt until 200ms
			if _, err := l.ReserveN(ctx, "s", 1); err != nil {
				t.Fatal(err)
			}
		}
		if res := allow(t, l, "s", 0); res.Allowed || res.Remaining != 0 || res.RetryAfter != 200*ms || res.ResetAfter != 300*ms {
			t.Fatalf("AllowN(0) in debt: %+v, want denied, retry after 200ms, reset after 300ms", res)
		}
		r, err := l.ReserveN(ctx, "s", 0)
		if err != nil || r.Delay() != 200*ms {
			t.Fatalf("ReserveN(0) in debt = %v, %v; want delay 200ms", r, err)
		}
	})
}

// AllowAtMost takes what every rule has, up to n (issue 11.4).
func TestAllowAtMost(t *testing.T) {
	eachAlgorithm(t, func(t *testing.T, l *Limiter, m *miniredis.Miniredis) {
		ctx := context.Background()
		time.Sleep(100 * ms)
		for _, tc := range []struct{ n, granted, remaining int }{
			{3, 3, 2}, // 3 of 5
			{4, 2, 0}, // only 2 left
			{1, 0, 0}, // none
		} {
			got, res, err := l.AllowAtMost(ctx, "s", tc.n)
			if err != nil || got != tc.granted || res.Allowed != (tc.granted > 0) || res.Remaining != tc.remaining {
				t.Fatalf("AllowAtMost(%d) = %d, %+v, %v; want %d granted, %d left", tc.n, got, res, err, tc.granted, tc.remaining)
			}
			if tc.granted == 0 && res.RetryAfter <= 0 {
				t.Fatalf("AllowAtMost(%d) denied without RetryAfter: %+v", tc.n, res)
			}
		}
		// n over the capacity is capped by it.
		time.Sleep(time.Hour)
		if got, _, err := l.AllowAtMost(ctx, "s", 100); err != nil || got != 5 {
			t.Fatalf("AllowAtMost(100) on a full rule = %d, %v; want 5", got, err)
		}
		if _, _, err := l.AllowAtMost(ctx, "s", -1); err == nil {
			t.Fatal("AllowAtMost(-1) succeeded, want an error")
		}
	})
}

// AllowAtMost(0) reads the state, as redis_rate's does (issue 20): it
// grants 0 and answers what AllowN(0) answers, charging and changing
// nothing.
func TestAllowAtMostZeroReads(t *testing.T) {
	eachAlgorithm(t, func(t *testing.T, l *Limiter, m *miniredis.Miniredis) {
		ctx := context.Background()
		time.Sleep(100 * ms) // inside the fixed window [0, 1s)
		check := func(when string) {
			t.Helper()
			before := fmt.Sprint(m.Dump())
			got, res, err := l.AllowAtMost(ctx, "s", 0)
			if err != nil || got != 0 {
				t.Fatalf("%s: AllowAtMost(0) = %d, %+v, %v; want 0 granted", when, got, res, err)
			}
			if want := allow(t, l, "s", 0); res != want {
				t.Fatalf("%s: AllowAtMost(0) answered %+v, AllowN(0) %+v; want the same", when, res, want)
			}
			if after := fmt.Sprint(m.Dump()); after != before {
				t.Fatalf("%s: AllowAtMost(0) changed the state:\n%s\nto\n%s", when, before, after)
			}
		}
		check("fresh")
		allow(t, l, "s", 3)
		check("3 of 5 taken")
		if res := allow(t, l, "s", 0); !res.Allowed || res.Remaining != 2 {
			t.Fatalf("AllowN(0) after: %+v, want allowed, 2 left", res)
		}
		if l.rules[0].Algorithm.bucket() {
			if _, err := l.ReserveN(ctx, "s", 5); err != nil {
				t.Fatal(err)
			}
			check("in debt")
		}
	})
}

// A policy: AllowAtMost takes what the tightest rule has.
func TestAllowAtMostPolicy(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10)},
			Rule{Name: "log", Algorithm: SlidingLog, Limit: Limit{Count: 4, Period: time.Hour, Burst: 4}})
		if got, res, err := l.AllowAtMost(ctx, "s", 8); err != nil || got != 4 || res.Rule != "log" || res.Remaining != 0 {
			t.Fatalf("AllowAtMost(8) = %d, %+v, %v; want 4 by the log", got, res, err)
		}
		if res := allow(t, l, "s", 0); res.Remaining != 0 || res.Rule != "log" {
			t.Fatalf("state after: %+v", res)
		}
		if res := allow(t, mustNew(t, rdb, Options{}, Rule{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10)}), "s", 0); res.Remaining != 6 {
			t.Fatalf("the GCRA rule was charged %d, want 4", 10-res.Remaining)
		}
	})
}

// Reset forgets the subject under every rule, and its pause.
func TestReset(t *testing.T) {
	eachAlgorithm(t, func(t *testing.T, l *Limiter, m *miniredis.Miniredis) {
		ctx := context.Background()
		allow(t, l, "s", 5)
		allow(t, l, "other", 2)
		if _, err := l.PauseFor(ctx, "s", time.Hour); err != nil {
			t.Fatal(err)
		}
		if err := l.Reset(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if res := allow(t, l, "s", 5); !res.Allowed {
			t.Fatalf("after Reset: %+v, want the full 5", res)
		}
		if left, err := l.PauseFor(ctx, "s", 0); err != nil || left != 0 {
			t.Fatalf("Paused after Reset = %v, %v; want 0", left, err)
		}
		if res := allow(t, l, "other", 0); res.Remaining != 3 {
			t.Fatalf("another subject after Reset: %d left, want 3", res.Remaining)
		}
		if err := l.Reset(ctx, ""); err == nil {
			t.Fatal("Reset of an empty subject succeeded")
		}
	})
}

// Delay is the time left from now, as in x/time/rate (issue 11.5).
func TestReservationDelayCountsDown(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		allow(t, l, "s", 1)
		r, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r.Delay() != 100*ms {
			t.Fatalf("Reserve = %v, %v; want delay 100ms", r, err)
		}
		time.Sleep(30 * ms)
		if d := r.Delay(); d != 70*ms {
			t.Fatalf("Delay 30ms later = %v, want 70ms", d)
		}
		time.Sleep(100 * ms)
		if d := r.Delay(); d != 0 {
			t.Fatalf("Delay after the time to act = %v, want 0", d)
		}
	})
}
