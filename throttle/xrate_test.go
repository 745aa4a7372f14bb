package throttle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

// The token bucket and GCRA against golang.org/x/time/rate, the reference
// users port from, on the same virtual clock: random limits (intervals
// that are not whole microseconds among them), random n including 0, and
// cancels before and after the time to act. Every decision must agree:
// admitted or not, the delay of a reservation (to the microsecond, Redis's
// unit, rounded up), and the whole tokens left.
//
// Where the two differ by design, the test stays out of the way, and the
// difference is in the table in doc.go:
//   - x/time/rate works in float64 tokens and truncated nanoseconds: its
//     times drift by about a nanosecond over a sequence, and a deficit
//     below 1 ns rounds to "admit now". Limits are drawn so that a real
//     deficit is at least 2 ns (the reduced count is at most 500), delays
//     are compared to within 2 ns before rounding up to the µs, and no
//     cancel is made within 1 µs of its time to act.
//   - A reservation cancelled while later ones hold its place is given
//     back here once those are cancelled too (x/time/rate keeps it). So
//     cancels before the time to act go from the latest down: none is
//     made after one of an earlier reservation whose time to act is still
//     ahead.
//   - n = 0 changes nothing here (x/time/rate's AllowN(0) moves its
//     lastEvent), so x/time/rate's side of n = 0 is computed from TokensAt.
func TestBucketsAgreeWithXRate(t *testing.T) {
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(algo), func(t *testing.T) {
			t.Parallel()
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				rng := rand.New(rand.NewPCG(xrateSeed, uint64(registry[algo].rank)))
				decisions := 0
				for trial := 0; decisions < 10_000; trial++ {
					decisions += xrateTrial(t, rdb, rng, algo, trial)
				}
				t.Logf("%d decisions, 0 mismatches", decisions)
			})
		})
	}
}

// xrateLimits are the limits the issue names, then random ones are drawn.
var xrateLimits = []Limit{
	{Count: 7, Period: time.Second, Burst: 2},
	{Count: 3, Period: time.Second, Burst: 1},
	{Count: 3, Period: time.Second, Burst: 3},
	{Count: 1000, Period: 7 * time.Second, Burst: 10},
	{Count: 1, Period: 24 * time.Hour, Burst: 1},
	{Count: 1, Period: 24 * time.Hour, Burst: 2},
}

func randomLimit(rng *rand.Rand, trial int) Limit {
	if trial < len(xrateLimits) {
		return xrateLimits[trial]
	}
	if trial%3 == 0 {
		return xrateLimits[rng.IntN(len(xrateLimits))]
	}
	periods := []time.Duration{time.Second, 7 * time.Second, 1500 * time.Millisecond, time.Minute, time.Hour, 24 * time.Hour, 333 * time.Microsecond}
	for {
		l := Limit{Count: 1 + rng.IntN(600), Period: periods[rng.IntN(len(periods))], Burst: 1 + rng.IntN(8)}
		if c, _ := lowestTerms(int64(l.Count), l.Period.Microseconds()); c <= 500 && (Rule{Name: "x", Algorithm: GCRA, Limit: l}).Validate() == nil {
			return l
		}
	}
}

// held is a reservation granted by both sides.
type held struct {
	ours *Reservation
	ref  *rate.Reservation
	at   time.Time // x/time/rate's time to act
}

// xrateTrial runs one random sequence on a fresh subject and returns the
// number of decisions compared.
func xrateTrial(t *testing.T, rdb *redis.Client, rng *rand.Rand, algo Algorithm, trial int) int {
	t.Helper()
	ctx := context.Background()
	lim := randomLimit(rng, trial)
	l := mustNew(t, rdb, Options{Prefix: "x:"}, Rule{Name: "r", Algorithm: algo, Limit: lim})
	ref := rate.NewLimiter(rate.Limit(float64(lim.Count)/lim.Period.Seconds()), lim.Burst)
	subject := fmt.Sprint("s", trial)
	_, period := lowestTerms(int64(lim.Count), lim.Period.Microseconds())
	tol := 0.1 / float64(period) // whole tokens: ours are exact in units of 1/period
	interval := float64(lim.Period.Microseconds()) / float64(lim.Count)

	var live []held
	var cancelledAhead []time.Time // times to act of cancels before them
	decisions := 0
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("trial %d, %v, %v at +%v: %s", trial, algo, lim, at(), fmt.Sprintf(format, args...))
	}
	for step := 0; step < 50; step++ {
		// Advance: often not at all, else up to a few intervals, in whole µs.
		if rng.IntN(3) > 0 {
			us := 1 + rng.Int64N(int64(math.Ceil(interval*float64(lim.Burst+1)))+1)
			time.Sleep(time.Duration(us) * time.Microsecond)
		}
		now := time.Now()
		n := rng.IntN(lim.Burst + 2) // 0 .. burst+1
		switch op := rng.IntN(10); {
		case op < 4: // Allow
			res, err := l.AllowN(ctx, subject, n)
			var want bool
			if n == 0 {
				want = xrateWait0(ref, now) == 0
			} else {
				want = ref.AllowN(now, n)
			}
			if n > lim.Burst {
				if !errors.Is(err, ErrExceedsCapacity) || want {
					fail("AllowN(%d) over the burst: %v, x/time/rate %v", n, err, want)
				}
				continue
			}
			if err != nil {
				fail("AllowN(%d): %v", n, err)
			}
			decisions++
			if res.Allowed != want {
				fail("AllowN(%d) allowed %v, x/time/rate %v (tokens %v)", n, res.Allowed, want, ref.TokensAt(now))
			}
			if got, want := res.Remaining, int(math.Floor(max(0, ref.TokensAt(now))+tol)); got != want {
				fail("AllowN(%d) remaining %d, x/time/rate %d (tokens %v)", n, got, want, ref.TokensAt(now))
			}
		case op < 8: // Reserve
			if n > lim.Burst {
				n = lim.Burst
			}
			r, err := l.ReserveN(ctx, subject, n)
			if err != nil {
				fail("ReserveN(%d): %v", n, err)
			}
			decisions++
			var want time.Duration
			if n == 0 {
				want = xrateWait0(ref, now)
			} else {
				xr := ref.ReserveN(now, n)
				if !xr.OK() {
					fail("x/time/rate refused ReserveN(%d)", n)
				}
				want = xr.DelayFrom(now)
				live = append(live, held{ours: r, ref: xr, at: now.Add(want)})
			}
			// Ours is exact, rounded up to the µs; x/time/rate's float64
			// tokens drift by about a nanosecond over a sequence.
			if got := r.Delay(); got != ceilMicro(want-2) && got != ceilMicro(want+2) {
				fail("ReserveN(%d) delay %v, x/time/rate %v", n, got, want)
			}
		default: // Cancel one held reservation
			if len(live) == 0 {
				continue
			}
			i := rng.IntN(len(live))
			h := live[i]
			if d := h.at.Sub(now); d > -time.Microsecond && d < time.Microsecond {
				continue // at its time to act: rounding decides, see above
			}
			before := h.at.After(now)
			if before && !cancelOrderOK(cancelledAhead, h.at, now) {
				continue
			}
			if err := h.ours.Cancel(ctx); err != nil {
				fail("Cancel: %v", err)
			}
			h.ref.CancelAt(now)
			if before {
				cancelledAhead = append(cancelledAhead, h.at)
			}
			live = append(live[:i], live[i+1:]...)
		}
	}
	return decisions
}

// xrateWait0 is x/time/rate's answer to a request of 0 at t (the delay its
// ReserveN(t, 0) would grant), without its side effect on lastEvent.
func xrateWait0(ref *rate.Limiter, t time.Time) time.Duration {
	tokens := ref.TokensAt(t)
	if tokens >= 0 {
		return 0
	}
	return time.Duration(-tokens / float64(ref.Limit()) * float64(time.Second))
}

// cancelOrderOK reports whether a cancel before the time to act at is
// outside the one case where this package gives back more than
// x/time/rate: an earlier reservation was cancelled before its time to
// act, which has not come yet, and this one comes after it.
func cancelOrderOK(cancelledAhead []time.Time, at, now time.Time) bool {
	for _, c := range cancelledAhead {
		if c.After(now) && c.Before(at) {
			return false
		}
	}
	return true
}

// ceilMicro rounds d up to a whole microsecond, as the scripts report.
func ceilMicro(d time.Duration) time.Duration {
	return (d + time.Microsecond - 1) / time.Microsecond * time.Microsecond
}

// xrateSeed fixes the random sequences, so a failure replays.
var xrateSeed uint64 = 11

// When Redis's clock steps back, the token bucket and GCRA answer more
// strictly than x/time/rate (the table in doc.go): their state is a time,
// the TAT, which stays where it was, so the bucket holds burst − (TAT −
// now) / T whole tokens by the earlier clock, fewer than before the step,
// and a bucket stepped back past its burst is in debt until the clock
// catches up. x/time/rate keeps the tokens it had counted. A TAT behind
// the stepped-back clock is a full bucket still. Both scripts: the fast
// one (an interval of whole µs) and bucket.lua (3 per second).
func TestBucketsClockStepsBack(t *testing.T) {
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		for _, lim := range []Limit{PerSecond(10), {Count: 3, Period: time.Second, Burst: 3}} {
			t.Run(string(algo)+"/"+lim.describe(), func(t *testing.T) {
				virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
					ctx := context.Background()
					l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: lim})
					ref := rate.NewLimiter(rate.Every(lim.interval()), lim.Burst)
					T, B := lim.interval(), lim.Burst
					t0 := time.Now()
					clock := func(d time.Duration) time.Time {
						m.SetTime(t0.Add(d))
						return t0.Add(d)
					}
					// whole tokens at TAT t0 + B×T, now t0 + d, by the formula
					tokens := func(d time.Duration) int { return max(0, int(d/T)) }
					if res := allow(t, l, "s", B); !res.Allowed || !ref.AllowN(clock(0), B) {
						t.Fatalf("the burst at t0: %+v", res)
					}
					ref.AllowN(clock(500*ms), 0)
					if res := allow(t, l, "s", 0); res.Remaining != tokens(500*ms) {
						t.Fatalf("at t0+500ms: %+v, want %d left", res, tokens(500*ms))
					}
					// 300ms back: the TAT stays, x/time/rate keeps its tokens.
					now := clock(200 * ms)
					full := ceilMicro(time.Duration(B)*lim.Period/time.Duration(lim.Count) - 200*ms)
					if res := allow(t, l, "s", 0); res.Remaining != tokens(200*ms) || res.ResetAfter != full {
						t.Fatalf("stepped back to t0+200ms: %+v, want %d left, full in %v", res, tokens(200*ms), full)
					}
					if got := int(ref.TokensAt(now)); got != tokens(500*ms) {
						t.Fatalf("x/time/rate stepped back: %d tokens, want the %d it had", got, tokens(500*ms))
					}
					// Back past the burst: in debt until t0 + T on the clock.
					clock(-time.Second)
					res := allow(t, l, "s", 1)
					if want := ceilMicro(time.Second + T); res.Allowed || res.Remaining != 0 || res.RetryAfter != want {
						t.Fatalf("stepped back to t0-1s: %+v, want denied, 0 left, retry after %v", res, want)
					}
					r, err := l.ReserveN(ctx, "s", 1)
					if want := ceilMicro(time.Second + T); err != nil || r.Delay() != want {
						t.Fatalf("ReserveN at t0-1s = %v, %v; want a delay of %v", r, err, want)
					}
					// A TAT that the stepped-back clock has passed: full.
					clock(2 * time.Second)
					allow(t, l, "f", 1)
					clock(10 * time.Second)
					clock(5 * time.Second)
					if res := allow(t, l, "f", 0); res.Remaining != B {
						t.Fatalf("a TAT behind the stepped-back clock: %+v, want %d left", res, B)
					}
				})
			})
		}
	}
}
