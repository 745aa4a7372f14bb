package throttle

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

func TestPrepayRedeem(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
		producer := mustNew(t, rdb, Options{}, rule)
		worker := mustNew(t, rdb, Options{}, rule)

		var receipts []string
		for i := range 5 {
			r, err := producer.PrepayN(ctx, "tenant", 1, time.Minute)
			if err != nil {
				t.Fatalf("PrepayN %d: %v", i, err)
			}
			if got, want := r.Delay(), time.Duration(i)*100*ms; got != want {
				t.Errorf("PrepayN %d: Delay = %v, want %v", i, got, want)
			}
			if receiptOf(r) == "" {
				t.Fatalf("PrepayN %d: empty receipt", i)
			}
			receipts = append(receipts, receiptOf(r))
		}
		// The prepaid permits are the ledger's: the next plain Wait comes
		// after them.
		if res := allow(t, worker, "tenant", 1); res.Allowed || res.RetryAfter != 500*ms {
			t.Errorf("after 5 prepaid: allowed=%v RetryAfter=%v; want denied, 500ms", res.Allowed, res.RetryAfter)
		}

		time.Sleep(200 * ms)
		for i, rc := range receipts {
			d, ok, err := redeem(ctx, worker, "tenant", rc)
			if err != nil || !ok {
				t.Fatalf("Redeem %d: %v, %v; want ok", i, ok, err)
			}
			if want := max(time.Duration(i)*100*ms-200*ms, 0); d != want {
				t.Errorf("Redeem %d at 200ms: delay %v, want %v", i, d, want)
			}
		}
		// Once only: a retry of the same job is charged as usual.
		if _, ok, err := redeem(ctx, worker, "tenant", receipts[0]); ok || err != nil {
			t.Errorf("second Redeem: ok=%v err=%v; want not ok, nil", ok, err)
		}
		// Redeeming charged nothing.
		if res := allow(t, worker, "tenant", 1); res.Allowed || res.RetryAfter != 300*ms {
			t.Errorf("after redeeming: allowed=%v RetryAfter=%v; want denied, 300ms", res.Allowed, res.RetryAfter)
		}
	})
}

// A receipt proves a charge only to a limiter with the same rules, for the
// same subject.
func TestRedeemRejects(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "api", Algorithm: TokenBucket, Limit: PerSecond(10)}
		producer := mustNew(t, rdb, Options{}, rule)
		r, err := producer.PrepayN(ctx, "tenant", 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		rc := receiptOf(r)
		cases := []struct {
			name    string
			lim     *Limiter
			subject string
			receipt string
		}{
			{"other subject", producer, "other", rc},
			{"other rules", mustNew(t, rdb, Options{}, rule, Rule{Name: "daily", Algorithm: GCRA, Limit: Limit{Count: 1000, Period: 24 * time.Hour, Burst: 1000}}), "tenant", rc},
			{"other rule name", mustNew(t, rdb, Options{}, Rule{Name: "api2", Algorithm: TokenBucket, Limit: PerSecond(10)}), "tenant", rc},
			{"other prefix", mustNew(t, rdb, Options{Prefix: "x:"}, rule), "tenant", rc},
			{"unknown receipt", producer, "tenant", "0123456789abcdef0123456789abcdef"},
			{"empty receipt", producer, "tenant", ""},
			{"long receipt", producer, "tenant", string(make([]byte, 1000))},
		}
		for _, c := range cases {
			if _, ok, err := redeem(ctx, c.lim, c.subject, c.receipt); ok || err != nil {
				t.Errorf("%s: ok=%v err=%v; want not ok, nil", c.name, ok, err)
			}
		}
		if _, ok, _ := redeem(ctx, producer, "tenant", rc); !ok {
			t.Error("the right limiter could not redeem the receipt")
		}
		if _, _, err := redeem(ctx, producer, "", rc); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("empty subject: %v, want ErrInvalidSubject", err)
		}
	})
}

func TestPrepayCancelDropsReceiptAndRefunds(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		first, err := l.PrepayN(ctx, "s", 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		second, err := l.PrepayN(ctx, "s", 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := second.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := redeem(ctx, l, "s", receiptOf(second)); ok {
			t.Error("a cancelled receipt was redeemed")
		}
		if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 100*ms {
			t.Errorf("after Cancel: allowed=%v RetryAfter=%v; want denied, 100ms (the refunded slot)", res.Allowed, res.RetryAfter)
		}
		if _, ok, _ := redeem(ctx, l, "s", receiptOf(first)); !ok {
			t.Error("the first receipt was lost")
		}
	})
}

// Receipts are kept keep after their slot, then forgotten.
func TestPrepayReceiptExpires(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(1).WithBurst(1)})
		old, err := l.PrepayN(ctx, "s", 1, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(11 * time.Second)
		// A later prepay trims the receipts past their keep.
		fresh, err := l.PrepayN(ctx, "s", 1, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if n, _ := rdb.ZCard(ctx, l.receiptsKey("s")).Result(); n != 1 {
			t.Errorf("%d receipts kept, want 1 (the old one trimmed)", n)
		}
		if _, ok, _ := redeem(ctx, l, "s", receiptOf(old)); ok {
			t.Error("an expired receipt was redeemed")
		}
		// The set's TTL outlives the newest receipt's keep, then it goes.
		time.Sleep(10*time.Second + time.Millisecond)
		if n, _ := rdb.Exists(ctx, l.receiptsKey("s")).Result(); n != 0 {
			t.Error("receipt set outlived its last receipt's keep")
		}
		_ = fresh
	})
}

func TestPrepayErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{MaxWait: time.Second}, Rule{Name: "b", Algorithm: GCRA, Limit: PerSecond(1).WithBurst(1)})
		if _, err := l.PrepayN(ctx, "s", 2, 0); !errors.Is(err, ErrExceedsCapacity) {
			t.Errorf("n above burst: %v, want ErrExceedsCapacity", err)
		}
		for range 2 {
			if _, err := l.PrepayN(ctx, "s", 1, 0); err != nil {
				t.Fatal(err)
			}
		}
		_, err := l.PrepayN(ctx, "s", 1, 0)
		var de *DelayError
		if !errors.As(err, &de) || !delayBy(err, false) || de.RetryAfter != 2*time.Second {
			t.Errorf("beyond MaxWait: %v, want a *DelayError matching ErrMaxWait, RetryAfter 2s", err)
		}
		if n, _ := rdb.ZCard(ctx, l.receiptsKey("s")).Result(); n != 2 {
			t.Errorf("%d receipts after a refused prepay, want 2", n)
		}
		if _, err := mustNew(t, downClient(t), Options{}, Rule{Name: "b", Algorithm: GCRA, Limit: PerSecond(1)}).PrepayN(ctx, "s", 1, 0); !errors.Is(err, ErrRedis) {
			t.Errorf("Redis down: %v, want ErrRedis", err)
		}
	})
}

// TestPrepayWindows paces 25 permits under windows of 10 per second: the
// windows book ahead too, 10 to a window for the fixed window, each permit
// a period after the one 10 before it for the sliding log.
func TestPrepayWindows(t *testing.T) {
	for _, tc := range []struct {
		algo Algorithm
		want func(i int) time.Duration
	}{
		{FixedWindow, func(i int) time.Duration { return time.Duration(i/10) * time.Second }},
		{SlidingLog, func(i int) time.Duration { return time.Duration(i/10) * time.Second }},
	} {
		t.Run(string(tc.algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, Rule{Name: "w", Algorithm: tc.algo, Limit: Limit{Count: 10, Period: time.Second}})
				for i := range 25 {
					r, err := l.PrepayN(ctx, "s", 1, time.Minute)
					if err != nil {
						t.Fatalf("PrepayN %d: %v", i, err)
					}
					if got, want := r.Delay(), tc.want(i); got != want {
						t.Errorf("PrepayN %d: slot in %v, want %v", i, got, want)
					}
				}
				if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 2*time.Second {
					t.Errorf("Allow after booking 25: %+v; want denied until the third window has room (2s)", res)
				}
			})
		})
	}
}

// With Options.PrepayAfter, a bucket's first prepaid slot is that long
// after the call, not now, and the next ones follow it an interval apart;
// the rules hold the permits at those slots (exactly: a plain Allow waits
// for the first free one after them), the receipts redeem at their slots,
// and the keys outlive the booking. A policy with a window rule ignores it.
func TestPrepayAfter(t *testing.T) {
	for _, algo := range []Algorithm{GCRA, TokenBucket} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				ctx := context.Background()
				rule := Rule{Name: "api", Algorithm: algo, Limit: PerSecond(10).WithBurst(2)}
				producer := mustNew(t, rdb, Options{PrepayAfter: 300 * ms}, rule)
				worker := mustNew(t, rdb, Options{}, rule)
				var receipts []string
				// Burst 2: two slots at 300ms, then one per 100ms.
				for i, want := range []time.Duration{300 * ms, 300 * ms, 400 * ms, 500 * ms} {
					r, err := producer.PrepayN(ctx, "s", 1, time.Minute)
					if err != nil {
						t.Fatalf("PrepayN %d: %v", i, err)
					}
					if r.Delay() != want {
						t.Errorf("PrepayN %d: Delay = %v, want %v", i, r.Delay(), want)
					}
					receipts = append(receipts, receiptOf(r))
				}
				if res := allow(t, worker, "s", 1); res.Allowed || res.RetryAfter != 600*ms {
					t.Errorf("after 4 prepaid from 300ms: allowed=%v RetryAfter=%v; want denied, 600ms", res.Allowed, res.RetryAfter)
				}
				if ttl := rdb.PTTL(ctx, "jobthrottle:{s}:api").Val(); ttl < 600*ms {
					t.Errorf("the rule's key lives %v, want at least until the last slot, 600ms", ttl)
				}
				time.Sleep(300 * ms)
				for i, rc := range receipts {
					d, ok, err := redeem(ctx, worker, "s", rc)
					if want := max(time.Duration(i-1), 0) * 100 * ms; err != nil || !ok || d != want {
						t.Errorf("Redeem %d at 300ms: %v, %v, %v; want ok after %v", i, d, ok, err, want)
					}
				}
			})
		})
	}
	t.Run("window rule ignores it", func(t *testing.T) {
		virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
			rules := []Rule{{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
				{Name: "day", Algorithm: FixedWindow, Limit: Limit{Count: 1000, Period: 24 * time.Hour}}}
			producer := mustNew(t, rdb, Options{PrepayAfter: 300 * ms}, rules...)
			r, err := producer.PrepayN(context.Background(), "s", 1, time.Minute)
			if err != nil || r.Delay() != 0 {
				t.Fatalf("PrepayN: %v, %v; want a slot now", r, err)
			}
		})
	})
	if _, err := New(redis.NewClient(&redis.Options{}), Options{PrepayAfter: -ms}, Rule{Name: "a", Algorithm: GCRA, Limit: PerSecond(1)}); err == nil {
		t.Error("a negative PrepayAfter: no error")
	}
}
