package throttle

import (
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// A backlog of LLM calls parked in the line under requests and tokens
// (tokens bind: 10 calls a second, with 3 s of burst, more than the line's
// horizon of 1 s, as a provider's minute's worth is):
// every third call comes back for its turn later than its tolerance (a
// parked task back on asynq's whole-second schedule), so that turn lapses
// and the call takes a new one. Each lapsed turn gives its tokens back
// (settled to nothing, as a settle gives back), so the backlog is served
// at the tokens' rate all the same: before, each lapse cost the rule one
// turn's tokens, and 90 calls took 3 s longer (issue 23: the configured
// run's last 3-5 %). Never more than the rules' bound in a window.
func TestBucketLapsedTurnsGiveBack(t *testing.T) {
	for _, algo := range []Algorithm{GCRA, TokenBucket} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				const calls, perCall, rate, burst = 90, 100, 1000, 3000 // tokens a second
				l := mustNew(t, rdb, Options{},
					Rule{Name: "requests", Algorithm: algo, Limit: PerSecond(100)},
					Rule{Name: "tokens", Algorithm: algo, Limit: PerSecond(rate).WithBurst(burst)})
				warm(t, l)
				s := newLineSim(t, rdb, l, time.Second)
				s.costs = Costs{1, perCall}
				lapsed := s.lateOnce(3, 300*ms) // past lineSim's tolerance of 50ms
				start := time.Now()
				for i := range calls {
					s.admit(fmt.Sprintf("task-%04d", i))
				}
				s.run(nil)
				if len(lapsed) < calls/5 {
					t.Fatalf("%d turns lapsed; the test needs about %d", len(lapsed), calls/3)
				}
				if got := len(s.admits); got != calls {
					t.Fatalf("%d calls started, want %d", got, calls)
				}
				var starts []time.Time
				last := time.Duration(0)
				for _, at := range s.admits {
					starts = append(starts, at)
					last = max(last, at.Sub(start))
				}
				// The burst (30 calls) at once, then 10 a second: the last
				// starts at 6 s, give or take the lateness of a call whose
				// turn lapsed near the end.
				ideal := time.Duration(calls-burst/perCall) * time.Second / time.Duration(rate/perCall)
				if last > ideal+400*ms {
					t.Errorf("the last of %d calls started at %v (%d turns lapsed); want about %v: the lapsed turns' tokens were lost", calls, last, len(lapsed), ideal)
				}
				// Within the rules' bound: the burst and a second's rate, plus
				// one turn (the tolerance).
				if got, bound := redistest.MaxInWindow(starts, time.Second), (burst+rate)/perCall+1; got > bound {
					t.Errorf("%d calls started in one second, bound %d", got, bound)
				}
			})
		})
	}
}
