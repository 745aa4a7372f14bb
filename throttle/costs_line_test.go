package throttle

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// llmBacklog drives a backlog of LLM calls through Admit with a horizon,
// as a fleet of workers parks them, on virtual time: every task arrives
// at once with costs per rule that are estimates, runs when its turn is
// granted or redeemed, and is settled at once to its real counts (or not
// at all, settle false). A task in line comes back when a serving hands
// it a turn; the line is served when an Admission or a serving says.
type llmBacklog struct {
	t       *testing.T
	lim     *Limiter
	horizon time.Duration
	settle  bool
	heads   bool             // the line served by its members' returns (AdmitRequest.HeadServes), as admission.Parking does
	est     map[string]Costs // each task's estimates
	real    map[string]Costs // and its real counts

	returns map[string]time.Time // when each task comes back
	serve   time.Time            // when the line is next served
	used    Costs                // real counts of the tasks run, per rule
	calls   int                  // Admit and ServeLine calls
	last    time.Time            // when the last task ran
	ran     int
}

// admit is one arrival of task id.
func (s *llmBacklog) admit(ctx context.Context, id string) {
	s.t.Helper()
	s.calls++
	a, err := s.lim.Admit(ctx, AdmitRequest{Subject: "key", Costs: s.est[id], Caller: Caller{ID: id}, Horizon: s.horizon, Tolerance: time.Second, HeadServes: s.heads})
	if err != nil {
		s.t.Fatalf("Admit %s: %v", id, err)
	}
	if s.heads {
		// The members this call booked, and the next head, are woken
		// for their turns.
		for who, slot := range a.Handed {
			if who != id {
				s.returns[who] = slot
			}
		}
		if a.Head != "" && a.Head != id {
			s.returns[a.Head] = a.Serve
		}
	}
	switch {
	case a.Status == Granted || a.Status == Redeemed:
		if a.Delay > 0 {
			s.returns[id] = a.At // not yet: come back at the slot
			return
		}
		delete(s.returns, id)
		s.ran++
		s.last = time.Now()
		for i, n := range s.real[id] {
			s.used[i] += n
		}
		if s.settle && a.Reservation != nil {
			if err := a.Reservation.SettleCosts(ctx, s.real[id]); err != nil {
				s.t.Fatalf("settle %s: %v", id, err)
			}
		}
	case a.Status == Booked || a.Status == Held:
		s.returns[id] = a.At
		if s.heads {
			if a.Head == id {
				s.returns[id] = a.Serve
			}
			return
		}
		if a.InLine && !a.Serve.IsZero() && (s.serve.IsZero() || a.Serve.Before(s.serve)) {
			s.serve = a.Serve
		}
	default:
		s.t.Fatalf("Admit %s: %+v", id, a)
	}
}

// run admits every task and drives the backlog until every task ran.
func (s *llmBacklog) run(ctx context.Context, ids []string) {
	for _, id := range ids {
		s.admit(ctx, id)
	}
	for s.ran < len(ids) {
		next, who := s.serve, ""
		for id, at := range s.returns {
			if next.IsZero() || at.Before(next) || (at.Equal(next) && who != "" && id < who) {
				next, who = at, id
			}
		}
		if next.IsZero() {
			s.t.Fatalf("%d of %d ran, and nothing is due", s.ran, len(ids))
		}
		time.Sleep(time.Until(next))
		if who == "" {
			s.calls++
			ls, err := s.lim.ServeLine(ctx, "key", s.horizon, Limit{})
			if err != nil {
				s.t.Fatal(err)
			}
			for id, slot := range ls.Handed {
				s.returns[id] = slot
			}
			s.serve = ls.Next
			continue
		}
		s.admit(ctx, who)
	}
}

// TestBacklogSettledCosts parks a backlog of 2,000 LLM calls whose
// estimates are 40 % above their real counts (requests 1, input and output
// tokens) under a policy whose input-token rule binds, and settles each
// call to its real counts when it runs: what a settle gives back moves the
// bucket's schedule back, and as the line books its members only within
// the horizon, the next ones served are booked earlier. The input-token
// rule is used at ≥ 95 % of its rate, past its first burst, and never
// above its bound. Without settling, the same backlog uses about 1/1.4 of
// it: the tokens booked at the estimates go unused. The same holds with
// the line served by its members (HeadServes, as admission.Parking serves
// it), at two limiter calls a call: the last member a serving booked
// serves the line when it redeems, so the turns it books start where the
// settles so far moved the schedule back (woken only at the turn the
// serving gave it, the next head found that room passed: 89 %).
func TestBacklogSettledCosts(t *testing.T) {
	for _, c := range []struct{ settle, heads bool }{{true, false}, {false, false}, {true, true}, {false, true}} {
		settle := c.settle
		t.Run(fmt.Sprintf("settle=%v,heads=%v", settle, c.heads), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				const rate = 6000 // input tokens a minute, and the burst
				l := mustNew(t, rdb, Options{},
					Rule{Name: "requests", Algorithm: GCRA, Limit: Limit{Count: 600, Period: time.Minute, Burst: 600}},
					Rule{Name: "input", Algorithm: GCRA, Limit: Limit{Count: rate, Period: time.Minute, Burst: rate}},
					Rule{Name: "output", Algorithm: GCRA, Limit: Limit{Count: 6000, Period: time.Minute, Burst: 6000}},
				)
				s := &llmBacklog{t: t, lim: l, horizon: 5 * time.Second, settle: settle, heads: c.heads,
					est: map[string]Costs{}, real: map[string]Costs{}, returns: map[string]time.Time{}, used: make(Costs, 3)}
				rng := rand.New(rand.NewPCG(23, 2))
				var ids []string
				for i := range 2000 {
					id := fmt.Sprintf("t%04d", i)
					in, out := 100+rng.IntN(201), 50+rng.IntN(101)
					s.real[id] = Costs{1, in, out}
					s.est[id] = Costs{1, in * 14 / 10, out * 14 / 10}
					ids = append(ids, id)
				}
				start := time.Now()
				s.run(context.Background(), ids)
				elapsed := s.last.Sub(start)
				// The bucket's bound: its burst at once, then its rate.
				bound := rate + float64(rate)*elapsed.Minutes()
				share := (float64(s.used[1]) - rate) / (float64(rate) * elapsed.Minutes())
				t.Logf("%d calls in %v: %d input tokens, %.1f %% of the rate past the first burst; %.2f limiter calls a call", s.ran, elapsed.Round(time.Second), s.used[1], 100*share, float64(s.calls)/float64(s.ran))
				if float64(s.used[1]) > bound {
					t.Errorf("%d input tokens in %v: above the bound %.0f", s.used[1], elapsed, bound)
				}
				if settle && share < 0.95 {
					t.Errorf("settled: %.1f %% of the input-token rate used, want at least 95 %%", 100*share)
				}
				if perTask := float64(s.calls) / float64(s.ran); c.heads && perTask > 2.05 {
					t.Errorf("%.2f limiter calls a call with heads serving, want at most 2.05 (a parked call's two)", perTask)
				}
				if !settle && (share < 0.68 || share > 0.75) {
					t.Errorf("not settled: %.1f %% used, want about 71 %% (1/1.4)", 100*share)
				}
			})
		})
	}
}
