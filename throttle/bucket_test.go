package throttle

import (
	"context"
	"errors"
	"math/big"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

var buckets = []Algorithm{TokenBucket, GCRA}

// 7 per second burst 2: an interval of 142857.142…µs. Two requests at one
// Redis instant are both admitted and the first leaves 1, as in
// x/time/rate (issue 11.1: a double holding 1.8e15µs rounded the TAT, so
// the first reported 0 left and the second was denied for 1µs).
func TestBucketIntervalNotWholeMicroseconds(t *testing.T) {
	for _, algo := range buckets {
		t.Run(string(algo), func(t *testing.T) {
			m := miniredis.RunT(t)
			rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
			t.Cleanup(func() { _ = rdb.Close() })
			// Today's Redis times (1.8e15µs, where a double keeps a quarter
			// µs), at an instant off every boundary.
			t0 := time.Date(2026, 11, 23, 14, 0, 0, 123456789, time.UTC)
			m.SetTime(t0)
			l := mustNew(t, rdb, Options{NoBatching: true}, Rule{Name: "r", Algorithm: algo, Limit: Limit{Count: 7, Period: time.Second, Burst: 2}})
			if res := allow(t, l, "s", 1); !res.Allowed || res.Remaining != 1 {
				t.Fatalf("first Allow: %+v, want allowed with 1 left", res)
			}
			if res := allow(t, l, "s", 1); !res.Allowed || res.Remaining != 0 {
				t.Fatalf("second Allow at the same instant: %+v, want allowed with 0 left", res)
			}
			// The next permit comes one interval after the first, 142857.142…µs:
			// denied at 142857µs, admitted at 142858µs.
			if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 142858*time.Microsecond {
				t.Fatalf("third Allow: %+v, want denied, retry after 142858µs", res)
			}
			m.SetTime(t0.Add(142857 * time.Microsecond))
			if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != time.Microsecond {
				t.Fatalf("at +142857µs: %+v, want denied, retry after 1µs", res)
			}
			m.SetTime(t0.Add(142858 * time.Microsecond))
			if res := allow(t, l, "s", 1); !res.Allowed {
				t.Fatalf("at +142858µs: %+v, want allowed", res)
			}
			// At +1s, seven intervals after the first two, the bucket is
			// full again: burst 2.
			m.SetTime(t0.Add(time.Second))
			got := 0
			for allow(t, l, "s", 1).Allowed {
				got++
			}
			if got != 2 {
				t.Fatalf("at +1s: %d admitted, want 2", got)
			}
		})
	}
}

// The largest limits the validator accepts still decide exactly: products
// such as burst × period pass 2^53 and go through bk_div's long
// multiplication.
func TestBucketHugeLimitsExact(t *testing.T) {
	for _, algo := range buckets {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				// count 2^40 - 1 per 10 years (prime to the period), burst
				// 2^40 - 1: burst × period ≈ 3.5e26.
				lim := Limit{Count: maxCount - 1, Period: maxPeriod, Burst: maxCount - 1}
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: lim})
				if res := allow(t, l, "s", lim.Burst); !res.Allowed || res.Remaining != 0 {
					t.Fatalf("the whole burst: %+v, want allowed, 0 left", res)
				}
				// One permit takes period / count ≈ 286.8µs to come back.
				res := allow(t, l, "s", 1)
				iv := float64(maxPeriod/time.Microsecond) / float64(lim.Count)
				if want := time.Duration(iv+1) * time.Microsecond; res.Allowed || res.RetryAfter != want {
					t.Fatalf("one more: %+v, want denied, retry after %v", res, want)
				}
				time.Sleep(res.RetryAfter)
				if res := allow(t, l, "s", 1); !res.Allowed {
					t.Fatalf("after RetryAfter: %+v, want allowed", res)
				}
			})
		})
	}
}

// Cancel after the time to act gives nothing back (issue 11.2): under 10/s
// burst 1, a permit granted at once and cancelled 20ms later does not let
// a second one in before 100ms. Before the time to act, it gives back
// what later reservations did not take.
func TestCancelAfterTimeToActRestoresNothing(t *testing.T) {
	eachBucket(t, func(t *testing.T, l *Limiter) {
		ctx := context.Background()
		r, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r.Delay() != 0 {
			t.Fatalf("Reserve = %v, %v; want a permit now", r, err)
		}
		time.Sleep(20 * ms)
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 80*ms {
			t.Fatalf("after a cancel past the time to act: %+v, want denied for 80ms", res)
		}
		// Before the time to act: a reservation at 100ms, cancelled
		// at 50ms while nothing came after it, is given back whole.
		r2, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r2.Delay() != 80*ms {
			t.Fatalf("Reserve = %v, %v; want delay 80ms", r2, err)
		}
		time.Sleep(30 * ms)
		if err := r2.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 50*ms {
			t.Fatalf("after cancelling the latest before its time: %+v, want denied for 50ms (its slot is free again)", res)
		}
	})
}

// A Wait whose context ends before its slot refunds only what the
// waiters behind it did not take; once its slot has passed, nothing.
func TestWaitRefundOnContextEnd(t *testing.T) {
	eachBucket(t, func(t *testing.T, l *Limiter) {
		bg := context.Background()
		if err := l.Wait(bg, "s"); err != nil { // the burst, at 0
			t.Fatal(err)
		}
		actx, cancelA := context.WithCancel(bg)
		done := make(chan error)
		go func() { done <- l.Wait(actx, "s") }() // slot at 100ms
		time.Sleep(ms)
		if _, err := l.ReserveN(bg, "s", 1); err != nil { // slot at 200ms, behind A
			t.Fatal(err)
		}
		time.Sleep(49 * ms)
		cancelA()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait = %v, want context.Canceled", err)
		}
		// A's slot is held up by the reservation behind it: nothing
		// comes back, the next slot is 300ms.
		r, err := l.ReserveN(bg, "s", 1)
		if err != nil || r.Delay() != 250*ms {
			t.Fatalf("Reserve at 50ms = %v, %v; want delay 250ms (slot 300ms)", r, err)
		}
	})
}

// The rollback over several subjects is not a Cancel: the part given back was never
// used, so it comes back even after its time to act (the second part's
// answer takes 5ms here).
func TestSubjectsRollbackAfterTimeToAct(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		slow := redistest.PipeClient(m)
		defer slow.Close()
		slow.AddHook(slowHook{5 * ms})
		first := Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
		second := Rule{Name: "once", Algorithm: FixedWindow, Limit: Limit{Count: 1, Period: time.Hour, Burst: 1}, Subject: "global"}
		g := mustNew(t, slow, Options{}, first, second)
		spent := second
		spent.Subject = ""
		allow(t, mustNew(t, rdb, Options{}, spent), "global", 1) // the second part is spent
		start := at()
		if res, err := g.Allow(ctx, "s"); err != nil || res.Allowed {
			t.Fatalf("Allow = %+v, %v; want denied by the second part", res, err)
		}
		if at() == start {
			t.Fatal("the rollback came at the instant of the grant; the test needs it later")
		}
		if res := allow(t, mustNew(t, rdb, Options{}, first), "s", 1); !res.Allowed {
			t.Fatalf("the first part after the rollback: %+v, want its permit back", res)
		}
	})
}

// slowHook delays every command by d (virtual time in a bubble).
type slowHook struct{ d time.Duration }

func (h slowHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h slowHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		time.Sleep(h.d)
		return next(ctx, cmd)
	}
}
func (h slowHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		time.Sleep(h.d)
		return next(ctx, cmds)
	}
}

// eachBucket runs f in a virtual bubble for the token bucket and GCRA,
// each with a limiter of one rule "r", 10 per second, burst 1.
func eachBucket(t *testing.T, f func(t *testing.T, l *Limiter)) {
	for _, algo := range buckets {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				f(t, mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(10).WithBurst(1)}))
			})
		})
	}
}

// bk_div (bucket.lua) is exact wherever the scripts use it: a*b = q*m + r,
// 0 <= r < m, for a, b, m below 2^53 (m below 2^52) whose quotient stays
// below 2^53, on both of its paths; checked against math/big on every
// backend's Lua.
func TestBucketDivisionExact(t *testing.T) {
	var src []byte
	for _, f := range []string{"prelude.lua", "bucket.lua"} {
		b, err := luaFiles.ReadFile("lua/" + f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(append(src, b...), '\n')
	}
	// bk_div over ARGV[2..], three numbers a, b, m at a time: "q r" each.
	script := redis.NewScript(string(src) + `
local out = {}
for i = 2, #ARGV, 3 do
  local q, r = bk_div(tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))
  out[#out + 1] = string.format('%d %d', q, r)
end
return out`)
	rng := rand.New(rand.NewPCG(11, 7))
	var args []any
	var want []string
	for len(want) < 2000 {
		m := 1 + rng.Int64N(1<<(1+rng.IntN(51)))
		a := rng.Int64N(1 << (1 + rng.IntN(52)))
		b := rng.Int64N(1 << (1 + rng.IntN(52)))
		q, r := new(big.Int).QuoRem(new(big.Int).Mul(big.NewInt(a), big.NewInt(b)), big.NewInt(m), new(big.Int))
		if q.BitLen() > 53 {
			continue
		}
		args = append(args, a, b, m)
		want = append(want, q.String()+" "+r.String())
	}
	for _, be := range redistest.Backends(t) {
		t.Run(be.Name, func(t *testing.T) {
			got, err := script.Run(context.Background(), be.Client, []string{redistest.Prefix(t) + "{x}"}, append([]any{"allow"}, args...)...).StringSlice()
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("bk_div(%d, %d, %d) = %s, want %s", args[3*i], args[3*i+1], args[3*i+2], got[i], want[i])
				}
			}
		})
	}
}
