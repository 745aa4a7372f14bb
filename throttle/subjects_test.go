package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// A global rule plus a per-tenant rule: a request is charged to both or to
// neither.
func TestSubjectsAllowRefundsEarlierParts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		tenantRule := Rule{Name: "tenant", Algorithm: FixedWindow, Limit: Limit{Count: 5, Period: time.Minute, Burst: 5}}
		tenant := mustNew(t, rdb, Options{}, tenantRule)
		g := mustNew(t, rdb, Options{}, tenantRule,
			Rule{Name: "global", Algorithm: SlidingLog, Limit: Limit{Count: 2, Period: time.Minute, Burst: 2}, Subject: "all"})
		for _, sub := range []string{"a", "b"} {
			if res, err := g.Allow(ctx, sub); err != nil || !res.Allowed {
				t.Fatalf("Allow(%s): %+v, %v; want allowed", sub, res, err)
			}
		}
		res, err := g.Allow(ctx, "c")
		if err != nil || res.Allowed || res.Rule != "global" || res.RetryAfter != time.Minute {
			t.Fatalf("third tenant: %+v, %v; want denied by global for 1m", res, err)
		}
		// c's tenant permit was refunded: all 5 are there.
		if got := allow(t, tenant, "c", 5); !got.Allowed {
			t.Fatalf("tenant c after the denied group request: %+v, want 5 permits left", got)
		}
	})
}

// Group.Wait reserves every bucket part without sleeping, then sleeps once,
// until the latest slot.
func TestSubjectsWaitSleepsUntilLatestSlot(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		g := mustNew(t, rdb, Options{},
			Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
			Rule{Name: "global", Algorithm: TokenBucket, Limit: PerSecond(4).WithBurst(1), Subject: "all"})
		var times []time.Duration
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, tenant := range []string{"a", "a", "b", "c"} {
			wg.Go(func() {
				if err := g.Wait(ctx, tenant); err != nil {
					t.Error(err)
				}
				mu.Lock()
				times = append(times, at())
				mu.Unlock()
			})
			synctest.Wait()
		}
		wg.Wait()
		want := []time.Duration{0, 250 * ms, 500 * ms, 750 * ms}
		for i := range want {
			if times[i] != want[i] {
				t.Fatalf("admissions at %v, want %v (the global 4/s paces everyone)", times, want)
			}
		}
	})
}

// If a later part cannot admit before the deadline, the earlier parts'
// reservations are refunded.
func TestSubjectsWaitFailureRefunds(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		tenantRule := Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
		tenant := mustNew(t, rdb, Options{}, tenantRule)
		g := mustNew(t, rdb, Options{}, tenantRule,
			Rule{Name: "global", Algorithm: FixedWindow, Limit: Limit{Count: 1, Period: time.Minute, Burst: 1}, Subject: "all"})
		if err := g.Wait(context.Background(), "a"); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		var de *DelayError
		if err := g.Wait(ctx, "a"); !errors.As(err, &de) || !de.Deadline || de.Rule != "global" {
			t.Fatalf("Wait: %v, want a deadline *DelayError from the global window", err)
		}
		// The tenant's slot at 100ms was given back.
		r, err := tenant.ReserveN(context.Background(), "a", 1)
		if err != nil || r.Delay() != 100*ms {
			t.Fatalf("tenant reservation after the failed group wait: %v, %v; want delay 100ms", r, err)
		}
	})
}

// Rules over one subject stay one part, decided in one call; a rule whose
// Subject is the caller's... is still one part. Bad subjects are
// configuration errors; PrepayN and AllowAtMost refuse several subjects.
func TestRulesOverSeveralSubjects(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		calls := countScripts(rdb)
		one := mustNew(t, rdb, Options{},
			Rule{Name: "a", Algorithm: GCRA, Limit: PerSecond(10), Subject: "x"},
			Rule{Name: "b", Algorithm: FixedWindow, Limit: PerSecond(10), Subject: "x"})
		warm(t, one)
		before := calls.Load()
		allow(t, one, "ignored", 1)
		if got := calls.Load() - before; got != 1 {
			t.Fatalf("two rules over one fixed subject: %d script calls, want 1 (one part)", got)
		}
		// The fixed subject is what is charged: another caller finds 8
		// left (warm's request and this one).
		if res := allow(t, one, "other", 0); res.Remaining != 8 {
			t.Fatalf("after two requests: %+v, want 8 remaining on the shared subject", res)
		}
		if _, err := New(rdb, Options{}, Rule{Name: "a", Algorithm: GCRA, Limit: PerSecond(1), Subject: strings.Repeat("x", 2000)}); err == nil || !strings.Contains(err.Error(), "subject") {
			t.Fatalf("a fixed subject over the length bound: %v, want a ConfigError for subject", err)
		}
		two := mustNew(t, rdb, Options{},
			Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10)},
			Rule{Name: "global", Algorithm: GCRA, Limit: PerSecond(10), Subject: "all"})
		if _, err := two.PrepayN(ctx, "t", 1, 0); err == nil {
			t.Fatal("PrepayN over several subjects succeeded, want an error")
		}
		if _, _, err := two.AllowAtMost(ctx, "t", 2); err == nil {
			t.Fatal("AllowAtMost over several subjects succeeded, want an error")
		}
	})
}

// A request over several subjects is charged to every part at the turn it
// acts, the latest of the parts' own: a tenant's part booked at its own
// earlier slot, while the busier global part holds the request back, would
// let the tenant's next requests act closer together than its rule
// allows (here 4 within 300ms under 4 a second, burst 1).
func TestSubjectsChargedAtTheTurnTheyAct(t *testing.T) {
	// spaced checks that the tenant's acts are at least d apart.
	spaced := func(d time.Duration) func([]time.Duration) string {
		return func(acts []time.Duration) string {
			for i := 1; i < len(acts); i++ {
				if acts[i]-acts[i-1] < d {
					return fmt.Sprintf("two %v apart, under its %v", acts[i]-acts[i-1], d)
				}
			}
			return ""
		}
	}
	// perWindow checks that no fixed second holds more than two acts.
	perWindow := func(acts []time.Duration) string {
		in := map[time.Duration]int{}
		for _, a := range acts {
			if in[a.Truncate(time.Second)]++; in[a.Truncate(time.Second)] > 2 {
				return fmt.Sprintf("3 in the window at %v, over its 2", a.Truncate(time.Second))
			}
		}
		return ""
	}
	// sliding checks that no second, from any act, holds more than two.
	sliding := func(acts []time.Duration) string {
		for i := 2; i < len(acts); i++ {
			if acts[i]-acts[i-2] < time.Second {
				return fmt.Sprintf("3 within %v, over its 2 a second", acts[i]-acts[i-2])
			}
		}
		return ""
	}
	for _, tc := range []struct {
		name   string
		tenant Rule
		check  func(acts []time.Duration) string
	}{
		{"gcra", Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(4).WithBurst(1)}, spaced(250 * ms)},
		{"token bucket", Rule{Name: "tenant", Algorithm: TokenBucket, Limit: PerSecond(4).WithBurst(1)}, spaced(250 * ms)},
		{"fixed window", Rule{Name: "tenant", Algorithm: FixedWindow, Limit: Limit{Count: 2, Period: time.Second}}, perWindow},
		{"sliding log", Rule{Name: "tenant", Algorithm: SlidingLog, Limit: Limit{Count: 2, Period: time.Second}}, sliding},
	} {
		for _, admit := range []bool{false, true} {
			if admit && tc.tenant.Algorithm != GCRA && tc.tenant.Algorithm != TokenBucket {
				continue // Admit meets bucket parts only (AdmitRequest.NotBefore)
			}
			t.Run(fmt.Sprintf("%s, admit %v", tc.name, admit), func(t *testing.T) {
				virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
					ctx := context.Background()
					calls := countScripts(rdb)
					g := mustNew(t, rdb, Options{}, tc.tenant,
						Rule{Name: "global", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1), Subject: "all"})
					act := func(subject string) time.Duration {
						if admit {
							a, err := g.Admit(ctx, AdmitRequest{Subject: subject, N: 1, Caller: Caller{ID: "c"}, Wait: time.Minute})
							if err != nil || a.Status != Granted {
								t.Fatalf("Admit(%s): %+v, %v; want Granted", subject, a, err)
							}
							return a.At.Sub(epoch)
						}
						r, err := g.ReserveN(ctx, subject, 1)
						if err != nil {
							t.Fatalf("ReserveN(%s): %v", subject, err)
						}
						return at() + r.Delay()
					}
					acts := []time.Duration{act("a")}
					var all []time.Duration
					for i := range 9 { // the global rule booked a second ahead
						all = append(all, act(fmt.Sprintf("b%d", i)))
					}
					before := calls.Load()
					for range 4 {
						acts = append(acts, act("a"))
					}
					all = append(all, acts...)
					slices.Sort(all)
					for i := 1; i < len(all); i++ {
						if d := all[i] - all[i-1]; d < 100*ms {
							t.Fatalf("acts at %v: two %v apart, under the global 10/s", all, d)
						}
					}
					if msg := tc.check(acts); msg != "" {
						t.Fatalf("tenant a acts at %v: %s", acts, msg)
					}
					// Each request meets in at most two passes: 4 calls (2
					// parts, one given back and booked again), not more.
					if got := calls.Load() - before; got > 4*4 {
						t.Errorf("%d script calls for 4 requests; want at most 16", got)
					}
				})
			})
		}
	}
}
