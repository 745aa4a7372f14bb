package throttle

import (
	"cmp"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// settleRules are one rule of each algorithm admitting 10 per second, the
// buckets with a burst of 10, so that 10 permits are there at once under
// every algorithm.
var settleRules = []Rule{
	{Name: "fw", Algorithm: FixedWindow, Limit: Limit{Count: 10, Period: time.Second}},
	{Name: "sl", Algorithm: SlidingLog, Limit: Limit{Count: 10, Period: time.Second}},
	{Name: "sw", Algorithm: SlidingWindow, Limit: Limit{Count: 10, Period: time.Second}, Precision: 100 * ms},
	{Name: "tb", Algorithm: TokenBucket, Limit: PerSecond(10)},
	{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10)},
}

// reserve books n permits or fails the test.
func reserve(t *testing.T, l *Limiter, subject string, n int) *Reservation {
	t.Helper()
	r, err := l.ReserveN(context.Background(), subject, n)
	if err != nil {
		t.Fatalf("ReserveN(%d): %v", n, err)
	}
	return r
}

// settle settles r to actual or fails the test.
func settle(t *testing.T, r *Reservation, actual int) {
	t.Helper()
	if err := r.Settle(context.Background(), actual); err != nil {
		t.Fatalf("Settle(%d): %v", actual, err)
	}
}

// TestSettleDown reserves 8 of 10 permits and settles to 3: the 5 unused
// come back exactly, under every algorithm, in the same instant.
func TestSettleDown(t *testing.T) {
	for _, rule := range settleRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, rule)
				r := reserve(t, l, "s", 8)
				if got := allow(t, l, "s", 0).Remaining; got != 2 {
					t.Fatalf("after reserving 8: remaining %d, want 2", got)
				}
				settle(t, r, 3)
				if got := allow(t, l, "s", 0).Remaining; got != 7 {
					t.Errorf("after settling 8 to 3: remaining %d, want 7", got)
				}
				if got := admitted(t, l, "s", 10); got != 7 {
					t.Errorf("admitted %d of 10 after settling, want 7", got)
				}
			})
		})
	}
}

// TestSettleUp reserves 8 and settles to 13: the rule is 3 permits in debt,
// and the next request waits for it. Buckets: 13 permits of 100ms each from
// now, so one more acts at 400ms (13 + 1 - burst 10). Windows: the window
// holds 13 of 10 until the reservation's permits leave, 1s on.
func TestSettleUp(t *testing.T) {
	for _, rule := range settleRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, rule)
				settle(t, reserve(t, l, "s", 8), 13)
				res := allow(t, l, "s", 1)
				want := time.Second
				if rule.Algorithm.bucket() {
					want = 400 * ms
				}
				if rule.Algorithm == SlidingWindow {
					want += rule.Precision // the oldest bucket counts whole
				}
				if res.Allowed || res.RetryAfter != want {
					t.Fatalf("after settling 8 to 13: allowed %v, retry after %v; want denied, %v", res.Allowed, res.RetryAfter, want)
				}
				r, err := l.ReserveN(context.Background(), "s", 1)
				if err != nil {
					t.Fatal(err)
				}
				if d := r.Delay(); d < want-ms || d > want+ms {
					t.Errorf("a reservation after the debt acts in %v, want %v", d, want)
				}
			})
		})
	}
}

// TestSettleAfterPause settles a bucket reservation after time has passed.
// Down: the permits come back only as far as the bucket still holds them
// (burst × interval after the time to act, none); so a reservation of 10
// settled to 0 after the bucket refilled and was drained again by another
// gives nothing back, and no window of one second admits more than 10 + 10.
// Up: still charged, from now.
func TestSettleAfterPause(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(alg), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "b", Algorithm: alg, Limit: PerSecond(10)})

				// Half a second on: 5 refilled; 8 -> 6 gives back 2.
				r := reserve(t, l, "half", 8)
				time.Sleep(500 * ms)
				settle(t, r, 6)
				if got := allow(t, l, "half", 0).Remaining; got != 10-6+5 {
					t.Errorf("half: remaining %d, want %d", got, 10-6+5)
				}

				// Refilled, then drained by another: 10 -> 0 gives nothing.
				first := reserve(t, l, "late", 10)
				time.Sleep(time.Second)
				reserve(t, l, "late", 10)
				settle(t, first, 0)
				if res := allow(t, l, "late", 1); res.Allowed {
					t.Errorf("late: a settle after the bucket refilled gave permits back (remaining %d)", res.Remaining)
				}

				// Up, two seconds on (full again): 10 -> 15 charges 5 from now.
				up := reserve(t, l, "up", 10)
				time.Sleep(2 * time.Second)
				settle(t, up, 15)
				if got := allow(t, l, "up", 0).Remaining; got != 5 {
					t.Errorf("up: remaining %d, want 5", got)
				}
			})
		})
	}
}

// TestSettleOnce: a reservation settles once; a second Settle or a Settle
// after Cancel errs and changes nothing; Cancel after Settle does nothing.
// Bad input errs before anything is sent.
func TestSettleOnce(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "g", Algorithm: GCRA, Limit: PerSecond(10)})
		r := reserve(t, l, "s", 4)
		if err := r.Settle(ctx, -1); err == nil || !strings.Contains(err.Error(), "negative") {
			t.Errorf("Settle(-1) = %v, want an error about a negative count", err)
		}
		settle(t, r, 2)
		if err := r.Settle(ctx, 0); !errors.Is(err, errSettled) {
			t.Errorf("second Settle = %v, want errSettled", err)
		}
		if err := r.Cancel(ctx); err != nil {
			t.Errorf("Cancel after Settle = %v, want nil", err)
		}
		if got := allow(t, l, "s", 0).Remaining; got != 8 {
			t.Errorf("remaining %d, want 8 (settled to 2, once)", got)
		}

		c := reserve(t, l, "c", 4)
		if err := c.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if err := c.Settle(ctx, 9); !errors.Is(err, errSettled) {
			t.Errorf("Settle after Cancel = %v, want errSettled", err)
		}
		if got := allow(t, l, "c", 0).Remaining; got != 10 {
			t.Errorf("remaining %d after Cancel then Settle, want 10", got)
		}

		slow := mustNew(t, rdb, Options{}, Rule{Name: "y", Algorithm: GCRA, Limit: Limit{Count: 1, Period: 87600 * time.Hour, Burst: 1}})
		if err := reserve(t, slow, "s", 1).Settle(ctx, 3); err == nil || !strings.Contains(err.Error(), "debt") {
			t.Errorf("Settle into 20 years of debt = %v, want an error", err)
		}
	})
}

// TestSettleRedeemed: a turn booked by Admit, or a receipt from PrepayN,
// is settled by whoever redeems it, under a policy of a bucket and a
// window; the redeemed reservation's Cancel gives nothing back.
func TestSettleRedeemed(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "g", Algorithm: GCRA, Limit: PerSecond(10)},
			Rule{Name: "w", Algorithm: SlidingWindow, Limit: Limit{Count: 10, Period: time.Second}, Precision: 100 * ms})
		reserve(t, l, "s", 10)
		a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 6, Caller: Caller{ID: "job"}, Wait: 0})
		if err != nil || a.Status != Booked {
			t.Fatalf("Admit = %v, %v; want booked", a.Status, err)
		}
		time.Sleep(time.Until(a.At))
		a, err = l.Admit(ctx, AdmitRequest{Subject: "s", N: 6, Caller: Caller{ID: "job"}, Wait: 0})
		if err != nil || a.Status != Redeemed || a.Reservation == nil {
			t.Fatalf("Admit = %v, %v; want redeemed with a reservation", a.Status, err)
		}
		before := allow(t, l, "s", 0).Remaining
		if err := (&Reservation{lim: l, subject: "s", n: 6, tickets: a.Reservation.tickets, spent: true}).Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if got := allow(t, l, "s", 0).Remaining; got != before {
			t.Errorf("Cancel of a redeemed turn: remaining %d, want %d (spent)", got, before)
		}
		settle(t, a.Reservation, 2)
		if got := allow(t, l, "s", 0).Remaining; got != before+4 {
			t.Errorf("redeemed booking settled 6 -> 2: remaining %d, want %d", got, before+4)
		}
		if kept, _ := rdb.HExists(ctx, l.ticketsKey("s"), l.member("job")).Result(); kept {
			t.Error("the redeemed booking's tickets are still kept")
		}

		p, err := l.PrepayN(ctx, "p", 5, 0)
		if err != nil {
			t.Fatal(err)
		}
		a, err = l.Admit(ctx, AdmitRequest{Subject: "p", N: 5, Caller: Caller{Receipt: receiptOf(p)}, Wait: time.Second})
		if err != nil || a.Status != Redeemed || a.Reservation == nil {
			t.Fatalf("Admit with a receipt = %v, %v; want redeemed with a reservation", a.Status, err)
		}
		settle(t, a.Reservation, 8)
		if got := allow(t, l, "p", 0).Remaining; got != 2 {
			t.Errorf("receipt settled 5 -> 8: remaining %d, want 2", got)
		}
	})
}

// TestSettleSubjects settles a reservation over two subjects: both parts.
func TestSettleSubjects(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{},
			Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10)},
			Rule{Name: "global", Algorithm: SlidingLog, Limit: Limit{Count: 20, Period: time.Second}, Subject: "all"})
		settle(t, reserve(t, l, "acme", 6), 1)
		if got := allow(t, l.mode.parts()[0].lim, "acme", 0).Remaining; got != 9 {
			t.Errorf("tenant: remaining %d, want 9", got)
		}
		if got := allow(t, l.mode.parts()[1].lim, "all", 0).Remaining; got != 19 {
			t.Errorf("global: remaining %d, want 19", got)
		}
	})
}

// TestSettleNeverOverAdmits runs workers that reserve a random estimate,
// act at their slot using a random part of it, and settle it after a
// random latency, on virtual time, with several reservations always
// outstanding. Taking each request's actual permits as used at its time to
// act, no window may hold more than the rule allows: for the buckets,
// burst + rate × span in any span; for the sliding window, count in any
// period. With a burst that covers the reservations outstanding (here
// 3s of the rate against at most 8 × 400 permits), a bucket gives back
// what each did not use and runs near its rate on the actual costs: at
// least 90% of it, where the estimates alone would allow about half. (The
// sliding window settles exactly too, but books a backlog period by
// period, whatever it gives back: only its bound is checked.)
func TestSettleNeverOverAdmits(t *testing.T) {
	const rate = 1000 // permits per second: 1 per ms
	for _, rule := range []Rule{
		{Name: "tb", Algorithm: TokenBucket, Limit: PerSecond(rate).WithBurst(3000)},
		{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(rate).WithBurst(3000)},
		{Name: "sw", Algorithm: SlidingWindow, Limit: Limit{Count: rate, Period: time.Second}, Precision: 20 * ms},
	} {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, rule)
				type use struct {
					at time.Duration
					n  int
				}
				var mu sync.Mutex
				var uses []use
				var wg sync.WaitGroup
				start := time.Now()
				for w := range 8 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rng := rand.New(rand.NewPCG(uint64(w), 7))
						for range 40 {
							est := 100 + rng.IntN(300)
							actual := rng.IntN(est + 1)
							r, err := l.ReserveN(context.Background(), "s", est)
							if err != nil {
								t.Error(err)
								return
							}
							time.Sleep(r.Delay())
							mu.Lock()
							uses = append(uses, use{time.Since(start), actual})
							mu.Unlock()
							time.Sleep(time.Duration(rng.IntN(400)) * ms)
							if err := r.Settle(context.Background(), actual); err != nil {
								t.Error(err)
								return
							}
						}
					}()
				}
				wg.Wait()
				slices.SortFunc(uses, func(a, b use) int { return cmp.Compare(a.at, b.at) })
				total := 0
				for i := range uses {
					sum := 0
					for j := i; j < len(uses); j++ {
						span := uses[j].at - uses[i].at
						sum += uses[j].n
						allowed := rule.Limit.Burst + int(span/ms)
						if !rule.Algorithm.bucket() {
							if span >= time.Second {
								break
							}
							allowed = rule.Limit.Count
						}
						if sum > allowed {
							t.Fatalf("%d permits used in [%v, %v], more than the %d allowed", sum, uses[i].at, uses[j].at, allowed)
						}
					}
					total += uses[i].n
				}
				span := uses[len(uses)-1].at - uses[0].at
				share := float64(total-rule.Limit.Burst) / (rate * span.Seconds())
				t.Logf("used %d permits in %v: at least %.1f%% of the rate, the burst aside", total, span, 100*share)
				if rule.Algorithm.bucket() && share < 0.9 {
					t.Errorf("used %.1f%% of the rate, want at least 90%%", 100*share)
				}
			})
		})
	}
}

// TestSettleRedeemedWithConcurrency: under a policy with a Concurrency
// rule, whose admit reply carries the waiters it woke after the tickets, a
// booked turn redeemed with a place still comes with its tickets and
// settles; the concurrency rule, whose ticket is empty, is left alone.
func TestSettleRedeemedWithConcurrency(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rate := Rule{Name: "rate", Algorithm: GCRA, Limit: PerSecond(10)}
		one := Rule{Name: "one", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: 30 * time.Second}}
		l := mustNew(t, rdb, Options{}, rate, one)
		state := mustNew(t, rdb, Options{}, rate) // reads the rate rule's key
		reserve(t, state, "s", 10)
		a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 6, Caller: Caller{ID: "job"}})
		if err != nil || a.Status != Booked || a.Rule != "rate" {
			t.Fatalf("Admit = %v by %q, %v; want booked by rate", a.Status, a.Rule, err)
		}
		time.Sleep(time.Until(a.At))
		a, err = l.Admit(ctx, AdmitRequest{Subject: "s", N: 6, Caller: Caller{ID: "job"}})
		if err != nil || a.Status != Redeemed || a.Reservation == nil || a.Lease == 0 {
			t.Fatalf("Admit = %+v, %v; want redeemed with a reservation and a place", a, err)
		}
		before := allow(t, state, "s", 0).Remaining
		settle(t, a.Reservation, 2)
		if got := allow(t, state, "s", 0).Remaining; got != before+4 {
			t.Errorf("redeemed booking settled 6 -> 2: remaining %d, want %d", got, before+4)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
	})
}
