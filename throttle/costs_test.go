package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// llmRules are an LLM provider's limits as one policy: requests, input
// tokens and output tokens per minute, each a GCRA bucket whose burst is
// its minute.
var llmRules = []Rule{
	{Name: "requests", Algorithm: GCRA, Limit: Limit{Count: 10, Period: time.Minute, Burst: 10}},
	{Name: "input", Algorithm: GCRA, Limit: Limit{Count: 1000, Period: time.Minute, Burst: 1000}},
	{Name: "output", Algorithm: GCRA, Limit: Limit{Count: 500, Period: time.Minute, Burst: 500}},
}

// remainingEach reads what each rule of l has left for subject now, each
// through a limiter of that rule alone (same keys).
func remainingEach(t *testing.T, rdb *redis.Client, l *Limiter, subject string) []int {
	t.Helper()
	var got []int
	for _, r := range l.Rules() {
		got = append(got, allow(t, mustNew(t, rdb, Options{}, r), subject, 0).Remaining)
	}
	return got
}

// TestAllowCosts charges each rule its own cost in one call, all or
// nothing: a request the input rule denies charges no rule, and says
// when the input rule admits it; a rule of cost 0 neither denies nor
// delays.
func TestAllowCosts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		calls := countScripts(rdb)
		res, err := l.AllowCosts(ctx, "key", Costs{1, 600, 200})
		if err != nil || !res.Allowed {
			t.Fatalf("first: %+v, %v; want allowed", res, err)
		}
		if got := calls.Load(); got > 2 { // EVALSHA, then EVAL the first time
			t.Errorf("%d script calls, want 1 (and 1 to load the script)", got)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 400, 300}; !slices.Equal(got, want) {
			t.Fatalf("remaining %v, want %v", got, want)
		}
		res, err = l.AllowCosts(ctx, "key", Costs{1, 600, 200})
		if err != nil || res.Allowed || res.Rule != "input" {
			t.Fatalf("second: %+v, %v; want denied by input", res, err)
		}
		// 200 input tokens more at 1000/min: 12s.
		if res.RetryAfter != 12*time.Second {
			t.Errorf("RetryAfter %v, want 12s", res.RetryAfter)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 400, 300}; !slices.Equal(got, want) {
			t.Fatalf("after a denial: remaining %v, want %v (nothing charged)", got, want)
		}
		// Input exhausted; a request that costs it nothing still goes.
		if res, err := l.AllowCosts(ctx, "key", Costs{0, 400, 0}); err != nil || !res.Allowed {
			t.Fatalf("input's last 400: %+v, %v", res, err)
		}
		res, err = l.AllowCosts(ctx, "key", Costs{1, 0, 300})
		if err != nil || !res.Allowed || res.Rule != "output" || res.Remaining != 0 {
			t.Fatalf("cost 0 on an empty input rule: %+v, %v; want allowed, output deciding with 0 left", res, err)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{8, 0, 0}; !slices.Equal(got, want) {
			t.Fatalf("remaining %v, want %v", got, want)
		}
	})
}

// TestCostsEveryAlgorithm decides per-rule costs under each algorithm:
// rules of 10 and 100, a request of 1 and 60 twice: the second is denied
// by the larger rule, and the smaller keeps 9.
func TestCostsEveryAlgorithm(t *testing.T) {
	for _, a := range rateAlgorithms() {
		t.Run(string(a), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				small := Rule{Name: "small", Algorithm: a, Limit: Limit{Count: 10, Period: time.Second, Burst: 10}}
				big := Rule{Name: "big", Algorithm: a, Limit: Limit{Count: 100, Period: time.Second, Burst: 100}}
				if a == SlidingWindow {
					small.Precision, big.Precision = 100*ms, 100*ms
				}
				l := mustNew(t, rdb, Options{}, small, big)
				if res, err := l.AllowCosts(ctx, "s", Costs{1, 60}); err != nil || !res.Allowed {
					t.Fatalf("first: %+v, %v", res, err)
				}
				res, err := l.AllowCosts(ctx, "s", Costs{1, 60})
				if err != nil || res.Allowed || res.Rule != "big" {
					t.Fatalf("second: %+v, %v; want denied by big", res, err)
				}
				if got, want := remainingEach(t, rdb, l, "s"), []int{9, 40}; !slices.Equal(got, want) {
					t.Fatalf("remaining %v, want %v", got, want)
				}
				r, err := l.ReserveCosts(ctx, "s", Costs{2, 30})
				if err != nil {
					t.Fatal(err)
				}
				if got, want := remainingEach(t, rdb, l, "s"), []int{7, 10}; !slices.Equal(got, want) {
					t.Fatalf("after reserving 2 and 30: remaining %v, want %v", got, want)
				}
				if err := r.Cancel(ctx); err != nil {
					t.Fatal(err)
				}
				if got, want := remainingEach(t, rdb, l, "s"), []int{9, 40}; !slices.Equal(got, want) {
					t.Fatalf("after Cancel: remaining %v, want %v", got, want)
				}
				r, err = l.ReserveCosts(ctx, "s", Costs{2, 30})
				if err != nil {
					t.Fatal(err)
				}
				if err := r.SettleCosts(ctx, Costs{1, 10}); err != nil {
					t.Fatal(err)
				}
				if got, want := remainingEach(t, rdb, l, "s"), []int{8, 30}; !slices.Equal(got, want) {
					t.Fatalf("after settling 2 and 30 to 1 and 10: remaining %v, want %v", got, want)
				}
			})
		})
	}
}

// TestSettleCosts settles an LLM call's estimate to its usage, each rule
// on its own, in one script call; a rule estimated at 0 is charged what
// it used.
func TestSettleCosts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		r, err := l.ReserveCosts(ctx, "key", Costs{1, 800, 400})
		if err != nil {
			t.Fatal(err)
		}
		calls := countScripts(rdb)
		if err := r.SettleCosts(ctx, Costs{1, 300, 100}); err != nil {
			t.Fatal(err)
		}
		if got := calls.Load(); got > 2 { // EVALSHA, then EVAL the first time
			t.Errorf("%d settle calls, want 1 (and 1 to load the script)", got)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 700, 400}; !slices.Equal(got, want) {
			t.Fatalf("remaining %v, want %v", got, want)
		}
		if err := r.SettleCosts(ctx, Costs{1, 300, 100}); err == nil {
			t.Fatal("a second settle: no error")
		}
		time.Sleep(ms)
		r, err = l.ReserveCosts(ctx, "key", Costs{1, 0, 100})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.SettleCosts(ctx, Costs{1, 200, 100}); err != nil {
			t.Fatal(err)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{8, 500, 300}; !slices.Equal(got, want) {
			t.Fatalf("after settling an input of 0 to 200: remaining %v, want %v", got, want)
		}
		// One actual for every rule is Settle. (A moment later: a bucket
		// gives back no more than room left by what was given back since
		// the reservation was booked, bucket_rare.lua.)
		time.Sleep(ms)
		r, err = l.ReserveCosts(ctx, "key", Costs{1, 100, 100})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Settle(ctx, 1); err != nil {
			t.Fatal(err)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{7, 499, 299}; !slices.Equal(got, want) {
			t.Fatalf("after Settle(1) of 1, 100, 100: remaining %v, want %v", got, want)
		}
	})
}

// TestAdmitCosts takes, books and redeems turns at per-rule costs; each
// turn's reservation settles each rule.
func TestAdmitCosts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		a, err := l.Admit(ctx, AdmitRequest{Subject: "key", Costs: Costs{1, 900, 100}, Caller: Caller{ID: "t1"}})
		if err != nil || a.Status != Granted {
			t.Fatalf("t1: %+v, %v; want granted", a, err)
		}
		if err := a.Reservation.SettleCosts(ctx, Costs{1, 300, 50}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ms) // see TestSettleCosts
		// Input has 700 left: 100 more come 6s on (1000/min), 5.999s from now.
		b, err := l.Admit(ctx, AdmitRequest{Subject: "key", Costs: Costs{1, 800, 100}, Caller: Caller{ID: "t2"}})
		if err != nil || b.Status != Booked || b.Rule != "input" || b.Delay != 6*time.Second-ms {
			t.Fatalf("t2: %+v, %v; want booked by input 6s on", b, err)
		}
		time.Sleep(b.Delay)
		c, err := l.Admit(ctx, AdmitRequest{Subject: "key", Costs: Costs{1, 800, 100}, Caller: Caller{ID: "t2"}})
		if err != nil || c.Status != Redeemed || c.Reservation == nil {
			t.Fatalf("t2 back: %+v, %v; want redeemed with a reservation", c, err)
		}
		if err := c.Reservation.SettleCosts(ctx, Costs{1, 200, 20}); err != nil {
			t.Fatal(err)
		}
		// requests 10 - 2 + 1 (6s); input 0 + 600 given back; output
		// 450 - 100 + 50 (6s) + 80 given back.
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 600, 480}; !slices.Equal(got, want) {
			t.Fatalf("remaining %v, want %v", got, want)
		}
	})
}

// TestCostsErrors: costs that do not fit the limiter are refused with
// what to do, before anything is charged.
func TestCostsErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		cases := []struct {
			name string
			err  error
			want string
		}{
			{"too few", errOf(l.AllowCosts(ctx, "k", Costs{1, 2})), "one per rule"},
			{"negative", errOf(l.AllowCosts(ctx, "k", Costs{1, -2, 3})), "must not be negative"},
			{"over capacity", errOf(l.AllowCosts(ctx, "k", Costs{1, 2, 501})), "at most 500"},
			{"N and Costs", errOf(l.Admit(ctx, AdmitRequest{Subject: "k", N: 1, Costs: Costs{1, 2, 3}})), "N or Costs"},
			{"all zero", errOf(l.Admit(ctx, AdmitRequest{Subject: "k", Costs: Costs{0, 0, 0}})), "every cost is 0"},
		}
		for _, c := range cases {
			if c.err == nil || !strings.Contains(c.err.Error(), c.want) || !strings.HasPrefix(c.err.Error(), "throttle: ") {
				t.Errorf("%s: %v; want an error with %q", c.name, c.err, c.want)
			}
		}
		if _, err := l.AllowCosts(ctx, "k", Costs{1, 2, 501}); !errors.Is(err, ErrExceedsCapacity) {
			t.Errorf("over capacity: %v; want ErrExceedsCapacity", err)
		}
		global := Rule{Name: "global", Algorithm: GCRA, Limit: Limit{Count: 100, Period: time.Minute, Burst: 100}, Subject: "all"}
		split := mustNew(t, rdb, Options{}, llmRules[0], global)
		if _, err := split.AllowCosts(ctx, "k2", Costs{1, 2}); err == nil || !strings.Contains(err.Error(), "caller's subject") {
			t.Errorf("rules over two subjects: %v; want an error", err)
		}
		// Equal costs are the single-n request, which every limiter takes.
		if res, err := split.AllowCosts(ctx, "k2", Costs{2, 2}); err != nil || !res.Allowed {
			t.Errorf("equal costs over two subjects: %+v, %v", res, err)
		}
		if got, want := remainingEach(t, rdb, l, "k"), []int{10, 1000, 500}; !slices.Equal(got, want) {
			t.Errorf("remaining %v, want %v: a refused request charges nothing", got, want)
		}
	})
}

// errOf returns the error of a call's two results.
func errOf[T any](_ T, err error) error { return err }

// TestTurnTolerance: Admit's default tolerance is the length of the
// caller's own turn under the tightest rule it charges, so a task of 600
// tokens under 4,000 tokens a second may come back up to 150ms late for
// its booking; one permit's interval (0.25ms, 1ms at least) would make
// nearly every parked task of a token rule late, its booking lost. With
// a request of 10 a second charged too, the tighter 100ms holds.
func TestTurnTolerance(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "requests", Algorithm: GCRA, Limit: Limit{Count: 10, Period: time.Second, Burst: 10}},
			Rule{Name: "tokens", Algorithm: GCRA, Limit: Limit{Count: 4000, Period: time.Second, Burst: 4000}})
		for _, c := range []struct {
			costs    Costs
			late     time.Duration
			redeemed bool // else too late: a new turn
		}{
			{Costs{0, 600}, 140 * ms, true}, // 600 × 0.25ms = 150ms
			{Costs{0, 600}, 160 * ms, false},
			{Costs{1, 600}, 90 * ms, true}, // requests: 100ms
			{Costs{1, 600}, 110 * ms, false},
		} {
			time.Sleep(2 * time.Second) // both full
			if a, err := l.Admit(ctx, AdmitRequest{Subject: "k", Costs: Costs{10, 4000}}); err != nil || a.Status != Granted {
				t.Fatalf("emptying the buckets: %+v, %v", a, err)
			}
			id := fmt.Sprint(c.costs, c.late)
			a, err := l.Admit(ctx, AdmitRequest{Subject: "k", Costs: c.costs, Caller: Caller{ID: id}})
			if err != nil || a.Status != Booked {
				t.Fatalf("%s: %+v, %v; want booked", id, a, err)
			}
			time.Sleep(a.Delay + c.late)
			b, err := l.Admit(ctx, AdmitRequest{Subject: "k", Costs: c.costs, Caller: Caller{ID: id}})
			if err != nil || (b.Status == Redeemed) != c.redeemed {
				t.Errorf("%s back %v late: %v, %v; want redeemed %v", id, c.late, b.Status, err, c.redeemed)
			}
		}
	})
}

// TestLineCostsPriority: callers in the line keep their costs beside their
// priority (a member's entry holds both): a serving books the higher
// level first, each at its own costs, and a rule of cost 0 holds neither.
func TestLineCostsPriority(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		if a, err := l.Admit(ctx, AdmitRequest{Subject: "key", Costs: Costs{1, 1000, 100}, Caller: Caller{ID: "first"}}); err != nil || a.Status != Granted {
			t.Fatalf("first: %+v, %v", a, err)
		}
		// Input is spent for a minute: both join the line, the high one
		// after the low one.
		req := func(id string, prio int, c Costs) AdmitRequest {
			return AdmitRequest{Subject: "key", Costs: c, Caller: Caller{ID: id, Priority: prio}, Horizon: time.Second, MaxAge: time.Hour}
		}
		for _, r := range []AdmitRequest{req("low", 0, Costs{1, 600, 100}), req("high", 5, Costs{1, 300, 50})} {
			if a, err := l.Admit(ctx, r); err != nil || !a.InLine {
				t.Fatalf("%s: %+v, %v; want in line", r.ID, a, err)
			}
		}
		time.Sleep(18 * time.Second) // 300 input tokens come back: high's turn, not low's
		s, err := l.ServeLine(ctx, "key", time.Second, Limit{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := s.Handed["high"]; !ok || len(s.Handed) != 1 || s.Waiting != 1 {
			t.Fatalf("serving: %+v; want high handed, low waiting", s)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 0, 450}; !slices.Equal(got, want) {
			t.Fatalf("after booking high: remaining %v, want %v", got, want)
		}
	})
}

// TestPrepayCosts: a producer books a turn at costs per rule with a
// receipt; the consumer redeems it with the same costs, charged nothing
// more, and settles each rule from what the turn took.
func TestPrepayCosts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, llmRules...)
		if err := l.CheckCosts("key", Costs{1, 2000, 1}); !errors.Is(err, ErrExceedsCapacity) {
			t.Errorf("CheckCosts over capacity: %v; want ErrExceedsCapacity", err)
		}
		if err := l.CheckCosts("", Costs{1, 2, 1}); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("CheckCosts of an empty subject: %v; want ErrInvalidSubject", err)
		}
		r, err := l.PrepayCosts(ctx, "key", Costs{1, 800, 300}, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		receipt, _ := r.Receipt()
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 200, 200}; !slices.Equal(got, want) {
			t.Fatalf("after prepaying: remaining %v, want %v", got, want)
		}
		a, err := l.Admit(ctx, AdmitRequest{Subject: "key", Costs: Costs{1, 800, 300}, Caller: Caller{ID: "job", Receipt: receipt}})
		if err != nil || a.Status != Redeemed || a.Reservation == nil {
			t.Fatalf("redeeming: %+v, %v; want redeemed with a reservation", a, err)
		}
		if err := a.Reservation.SettleCosts(ctx, Costs{1, 500, 100}); err != nil {
			t.Fatal(err)
		}
		if got, want := remainingEach(t, rdb, l, "key"), []int{9, 500, 400}; !slices.Equal(got, want) {
			t.Fatalf("after settling: remaining %v, want %v", got, want)
		}
	})
}

// Two buckets over one subject, where each binds in turn (costs per rule:
// requests and tokens): every turn is charged to both when it acts, so
// neither rule's turns come closer than its own limit allows.
func TestTurnChargedToEveryRuleWhenItActs(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "requests", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
			Rule{Name: "tokens", Algorithm: TokenBucket, Limit: PerSecond(100).WithBurst(100)})
		var turns []time.Duration
		for i, tokens := range []int{100, 1, 100, 1, 1} {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "s", Costs: Costs{1, tokens}, Caller: Caller{ID: fmt.Sprint(i)}, Wait: 0, Tolerance: 10 * ms})
			if err != nil {
				t.Fatal(err)
			}
			turns = append(turns, a.Delay)
		}
		for i := 1; i < len(turns); i++ {
			if gap := turns[i] - turns[i-1]; gap < 100*ms-ms {
				t.Errorf("turns %v: %v and %v are %v apart, under the requests' 10/s", turns, turns[i-1], turns[i], gap)
			}
		}
	})
}

// A sliding log or window beside a token bucket: a request the bucket
// holds back is recorded when it acts, so no window of the rule's period
// holds more than its count of the requests as they act (before, one
// recorded at the log's own earlier time left room for a third).
func TestTurnRecordedInTheSlidingWindowItActsIn(t *testing.T) {
	for _, algo := range []Algorithm{SlidingLog, SlidingWindow} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{},
					Rule{Name: "window", Algorithm: algo, Limit: Limit{Count: 2, Period: time.Second, Burst: 2}, Precision: 10 * ms},
					Rule{Name: "tokens", Algorithm: TokenBucket, Limit: PerSecond(10).WithBurst(10)})
				var acts []time.Time
				for i, c := range []Costs{{0, 10}, {1, 5}, {1, 0}, {1, 0}, {1, 0}} {
					a, err := l.Admit(ctx, AdmitRequest{Subject: "s", Costs: c, Caller: Caller{ID: fmt.Sprint(i)}, Wait: 0, Tolerance: 10 * ms})
					if err != nil {
						t.Fatal(err)
					}
					if c[0] > 0 {
						acts = append(acts, time.Now().Add(a.Delay))
					}
				}
				if got := redistest.MaxInWindow(acts, time.Second); got > 2 {
					t.Errorf("%d requests act within one second, the rule's count is 2", got)
				}
			})
		})
	}
}

// A fixed window beside a token bucket: a request the bucket holds back
// into the next window is counted in the window it acts in, so no window
// admits more than its count (before, it was counted in the window of the
// fixed window's own earliest time, and the next window took two more).
func TestTurnChargedToTheWindowItActsIn(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "window", Algorithm: FixedWindow, Limit: Limit{Count: 2, Period: time.Second, Burst: 2}},
			Rule{Name: "tokens", Algorithm: TokenBucket, Limit: PerSecond(10).WithBurst(10)})
		time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(900 * ms)))
		acts := map[int64]int{}
		for i, c := range []Costs{{0, 10}, {1, 5}, {1, 0}, {1, 0}, {1, 0}} {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "s", Costs: c, Caller: Caller{ID: fmt.Sprint(i)}, Wait: 0, Tolerance: 10 * ms})
			if err != nil {
				t.Fatal(err)
			}
			if c[0] > 0 {
				acts[time.Now().Add(a.Delay).Unix()]++
			}
		}
		for sec, n := range acts {
			if n > 2 {
				t.Errorf("%d requests act in the window of second %d, the window's count is 2 (%v)", n, sec, acts)
			}
		}
	})
}
