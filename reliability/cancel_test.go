package reliability

import (
	"context"
	"errors"
	"flag"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

var stormWaiters = flag.Int("storm.waiters", 10_000, "Waits cancelled in TestCancellationStorm")

// TestCancellationStorm starts 10,000 Waits on one subject of a token
// bucket and of a GCRA limiter (300/s, burst 10: slots up to 33s ahead),
// split between two limiters with their own clients as two worker
// processes would be, then cancels every one of them, in random order,
// before its slot. All the capacity must come back: afterwards the subject
// behaves exactly as a subject nobody touched, permit for permit: the
// whole burst at once, then the next 300 reservations each where a fresh
// bucket books it (assertLikeFresh).
// Every key left under the prefix has a TTL and is gone after it. The
// backends subtest repeats a smaller storm on miniredis, the shared Redis
// and the Redis Cluster (CI), where the refund's extra keys must share the
// subject's slot.
func TestCancellationStorm(t *testing.T) {
	// 300/s: an interval of 3333.3µs, which no Redis time in the ledger
	// hits exactly, so rounding in the scripts shows.
	const perSecond, burst = 300, 10
	for _, algo := range []throttle.Algorithm{throttle.GCRA, throttle.TokenBucket} {
		rule := throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.PerSecond(perSecond).WithBurst(burst)}
		t.Run(string(algo), func(t *testing.T) {
			srv := redistest.Server(t)
			prefix := redistest.Prefix(t)
			var lims []*throttle.Limiter
			var reserved, refunds []*atomic.Int64
			for range 2 {
				rdb := srv.Client(t)
				reserved = append(reserved, countOps(rdb, "reserve"))
				refunds = append(refunds, countOps(rdb, "refund"))
				lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rule)
				if err != nil {
					t.Fatal(err)
				}
				lims = append(lims, lim)
			}
			n := *stormWaiters
			st := storm(t, lims, "storm", n, func() int64 { return reserved[0].Load() + reserved[1].Load() })
			t.Logf("%d Waits (2 limiters) booked in %v; cancelled in random order, refunded in %v (%d refund calls); %d admitted (the burst and the slots reached before the cancel), %d cancelled",
				n, st.booked.Round(time.Millisecond), st.refunded.Round(time.Millisecond), refunds[0].Load()+refunds[1].Load(), st.admitted, st.cancelled)
			// Only slots reached before the Wait was cancelled are admitted:
			// the burst plus one per interval until the last cancel.
			if limit := burst + int((st.booked+st.refunded)/(time.Second/perSecond)) + 1; st.admitted > limit {
				t.Errorf("%d Waits were admitted; want at most %d, the burst and the slots that passed before the cancel", st.admitted, limit)
			}
			worst := assertLikeFresh(t, lims[0], "storm", perSecond)
			t.Logf("after the storm: the whole burst, then %d reservations each within %v of a fresh subject's", perSecond, worst.Round(time.Microsecond))

			// A second storm, left where it is: the keys it leaves
			// (state and cancelled-slot records) must all expire.
			smallStorm(t, lims[0], "hygiene", 300)
			assertKeyHygiene(t, srv.Client(t), prefix)
		})
	}
	t.Run("backends", func(t *testing.T) {
		for _, b := range redistest.Backends(t) {
			t.Run(b.Name, func(t *testing.T) {
				booked := countOps(b.Client, "reserve") // storm counts from its own start
				for _, algo := range []throttle.Algorithm{throttle.GCRA, throttle.TokenBucket} {
					prefix := redistest.Prefix(t)
					// A tenth of the rate: the storm's slots reach 33s ahead, so
					// some are always left to cancel, and assertLikeFresh's lag
					// budget (burst − 1 intervals) is 300ms, not 30ms, which a
					// loaded machine's scheduling does not eat.
					lim, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
						throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.PerSecond(perSecond / 10).WithBurst(burst)})
					if err != nil {
						t.Fatal(err)
					}
					st := storm(t, []*throttle.Limiter{lim}, "storm-"+string(algo), 1000, booked.Load)
					if st.cancelled == 0 {
						t.Fatalf("%v: no Wait was cancelled", algo)
					}
					assertLikeFresh(t, lim, "storm-"+string(algo), perSecond/10)
					if b.Mini == nil {
						assertKeyHygiene(t, b.Client, prefix)
					} else {
						assertKeyHygiene(t, b.Client, prefix, b.Mini)
					}
				}
			})
		}
	})
}

// stormResult is what storm measured.
type stormResult struct {
	booked, refunded    time.Duration
	admitted, cancelled int
}

// storm starts n Waits on subject, spread over lims, waits until
// reserved() says all n have their slot, cancels them all in random order
// and waits for every Wait to return (a cancelled Wait returns after its
// refund).
func storm(t *testing.T, lims []*throttle.Limiter, subject string, n int, reserved func() int64) stormResult {
	t.Helper()
	base := reserved()
	cancels := make([]context.CancelFunc, n)
	results := make(chan error, n)
	start := time.Now()
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		cancels[i] = cancel
		lim := lims[i%len(lims)]
		go func() { results <- lim.Wait(ctx, subject) }()
	}
	for deadline := time.Now().Add(2 * time.Minute); reserved()-base < int64(n); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			for _, c := range cancels {
				c()
			}
			t.Fatalf("only %d of %d Waits reserved within 2 minutes", reserved()-base, n)
		}
	}
	var st stormResult
	st.booked = time.Since(start)
	rand.Shuffle(n, func(i, j int) { cancels[i], cancels[j] = cancels[j], cancels[i] })
	cancelled := time.Now()
	for _, c := range cancels {
		c()
	}
	for range n {
		switch err := <-results; {
		case err == nil:
			st.admitted++
		case errors.Is(err, context.Canceled):
			st.cancelled++
		default:
			t.Errorf("Wait = %v; want nil or context.Canceled", err)
		}
	}
	st.refunded = time.Since(cancelled)
	return st
}

// assertLikeFresh checks that subject has exactly the capacity of a
// subject nobody used: after waiting for the burst to refill (the Waits
// whose slots came before the cancel used their permits, rightly), AllowN
// takes the whole burst at once, and then each of permits reservations is
// booked exactly where a fresh bucket books it: the k-th at k intervals
// after the burst was taken, on Redis's clock. The test cannot read
// Redis's clock, but each call's Redis time lies between the local times
// before and after the call, which bounds every expected delay; a delay
// outside its bounds by more than 1ms (rounding) fails. It returns the
// largest distance from the middle of the bounds.
//
// When the test itself falls behind (a loaded CI machine) a slot may have
// passed before its Reserve: a fresh bucket then books it at once, so the
// bounds are clamped at 0. That holds while the lag is shorter than
// burst-1 intervals; a longer stall lets a fresh bucket refill to its
// burst, the bounds say nothing, so that reservation is not judged and the
// sequence starts again after a refill, at most maxResyncs times. A lost
// refund leaves the bucket booked ahead for good, so it shows in every
// sequence.
func assertLikeFresh(t *testing.T, lim *throttle.Limiter, subject string, permits int) time.Duration {
	t.Helper()
	const (
		slack      = time.Millisecond
		maxResyncs = 5
	)
	ctx := context.Background()
	state, err := lim.AllowN(ctx, subject, 0) // charges nothing; names the rule
	if err != nil {
		t.Fatal(err)
	}
	l := state.Limit
	interval := float64(l.Period) / float64(l.Count)
	refill := time.Duration(float64(l.Burst)*interval) + 10*time.Millisecond
	maxLag := time.Duration(float64(l.Burst-1)*interval) - slack
	var worst time.Duration
	checked := 0
	for resyncs := 0; checked < permits; resyncs++ {
		if resyncs > maxResyncs {
			t.Fatalf("the test fell behind by a refill %d times; checked only %d of %d permits", resyncs, checked, permits)
		}
		time.Sleep(refill)
		a0 := time.Now()
		res, err := lim.AllowN(ctx, subject, l.Burst)
		a1 := time.Now()
		if err != nil || !res.Allowed {
			t.Fatalf("AllowN(burst %d) after the storm = %+v, %v; want the whole burst back", l.Burst, res, err)
		}
		for k := 1; checked < permits; k++ {
			c0 := time.Now()
			r, err := lim.ReserveN(ctx, subject, 1)
			c1 := time.Now()
			if err != nil {
				t.Fatal(err)
			}
			due := time.Duration(float64(k) * interval)
			lo, hi := due-c1.Sub(a0), due-c0.Sub(a1)
			if -lo >= maxLag {
				t.Logf("permit %d after the burst: the test fell %v behind its slot, long enough for a refill; starting a fresh sequence",
					k, (-lo).Round(10*time.Microsecond))
				break
			}
			lo, hi = max(lo, 0), max(hi, 0)
			if d := r.Delay(); d < lo-slack || d > hi+slack {
				t.Fatalf("permit %d after the burst: delay %v; a fresh subject's lies in [%v, %v]: capacity was not given back exactly",
					k, d.Round(10*time.Microsecond), lo.Round(10*time.Microsecond), hi.Round(10*time.Microsecond))
			}
			worst = max(worst, (r.Delay() - (lo+hi)/2).Abs())
			checked++
		}
	}
	return worst
}

// smallStorm books n Waits on subject and cancels every other one (so
// that some cancelled slots are not the last), then the rest.
func smallStorm(t *testing.T, lim *throttle.Limiter, subject string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	cancels := make([]context.CancelFunc, n)
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		cancels[i] = cancel
		wg.Go(func() { _ = lim.Wait(ctx, subject) })
	}
	time.Sleep(200 * time.Millisecond)
	for i := 0; i < n; i += 2 {
		cancels[i]()
	}
	time.Sleep(100 * time.Millisecond)
	for _, c := range cancels {
		c()
	}
	wg.Wait()
}

// countOps counts the limiter script calls with operation op (ARGV[1])
// that Redis answered without error.
func countOps(rdb redis.UniversalClient, op string) *atomic.Int64 {
	var n atomic.Int64
	rdb.AddHook(opHook{op: op, n: &n})
	return &n
}

type opHook struct {
	op string
	n  *atomic.Int64
}

func (opHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (opHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h opHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil && scriptOp(cmd) == h.op {
			h.n.Add(1)
		}
		return err
	}
}

// scriptOp returns ARGV[1] of an EVAL or EVALSHA command, or "".
func scriptOp(cmd redis.Cmder) string {
	name := strings.ToLower(cmd.Name())
	if name != "evalsha" && name != "eval" && name != "evalsha_ro" && name != "eval_ro" {
		return ""
	}
	args := cmd.Args()
	if len(args) < 3 {
		return ""
	}
	nkeys, ok := args[2].(int)
	if !ok {
		return ""
	}
	if i := 3 + nkeys; i < len(args) {
		if s, ok := args[i].(string); ok {
			return s
		}
	}
	return ""
}
