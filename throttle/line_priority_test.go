package throttle

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// runTo processes the events due by end, then sleeps until end.
func (s *lineSim) runTo(end time.Time) {
	s.t.Helper()
	for {
		next, id := s.next()
		if next.IsZero() || next.After(end) {
			time.Sleep(time.Until(end))
			return
		}
		s.step(next, id)
	}
}

// checkOnce checks that each of n callers was admitted once (admit fails
// the test on a second admission), the rule's bound in every window of
// its period, and at most one join and one redemption per caller besides
// the servings.
func (s *lineSim) checkOnce(rule Rule, n int) {
	s.t.Helper()
	if len(s.admits) != n {
		s.t.Fatalf("%d of %d callers admitted", len(s.admits), n)
	}
	var starts []time.Time
	for _, at := range s.admits {
		starts = append(starts, at)
	}
	if got, bound := redistest.MaxInWindow(starts, rule.Limit.Period), windowBound(rule); got > bound {
		s.t.Errorf("%d admissions in one period, bound %d", got, bound)
	}
	if calls, want := s.calls.Load(), int64(2*n+s.serves); calls > want {
		s.t.Errorf("%d script calls for %d callers and %d servings, want at most %d", calls, n, s.serves, want)
	}
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// highFirst gives callers H... priority 2, the others 0.
func highFirst(id string) int {
	if id[0] == 'H' {
		return 2
	}
	return 0
}

// TestLinePriority fills the line of a 10/s subject with 100 callers of
// priority 0, serves it for two seconds, then 20 callers of priority 2
// join: under every algorithm, the next 20 turns the line hands out are
// theirs, in arrival order, and every low still in line starts after
// every high: the highs wait only for the low turns already booked within
// the horizon, which are kept; then the lows go on in order. Each caller is admitted once, the
// rule's bound holds in every window, and the calls per caller are those
// of a line without priorities: one to join, one to redeem.
func TestLinePriority(t *testing.T) {
	for _, rule := range admitRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, rule)
				warm(t, l)
				s := newLineSim(t, rdb, l, time.Second)
				s.prio = highFirst
				for i := range 100 {
					s.admit(fmt.Sprintf("L%04d", i))
				}
				s.runTo(time.Now().Add(2 * time.Second))
				joined := time.Now()
				for i := range 20 {
					s.admit(fmt.Sprintf("H%04d", i))
				}
				mark := len(s.order)
				s.run(nil)
				next := s.order[mark : mark+20]
				for i, id := range next {
					if id != fmt.Sprintf("H%04d", i) {
						t.Fatalf("the 20 turns handed after the highs joined: %s; want H0000 to H0019 in order", strings.Join(next, " "))
					}
				}
				// Every low still in line when the highs joined starts
				// after every high; a low booked by then keeps its turn.
				handed := map[string]bool{}
				for _, id := range s.order[:mark] {
					handed[id] = true
				}
				var lastHigh time.Time
				for i := range 20 {
					lastHigh = maxTime(lastHigh, s.admits[fmt.Sprintf("H%04d", i)])
				}
				for id := range s.inLine {
					if id[0] == 'L' && !handed[id] && s.admits[id].Before(lastHigh) {
						t.Errorf("%s, in line when the highs joined, admitted at %v, before the last high (%v)", id, s.admits[id].Sub(joined), lastHigh.Sub(joined))
					}
				}
				// The booked lows within a horizon, then 20 highs at 10/s.
				if late, bound := lastHigh.Sub(joined), time.Second+2*time.Second+500*ms; late > bound {
					t.Errorf("the last high admitted %v after the highs joined, want at most %v", late, bound)
				}
				for i := mark + 20 + 1; i < len(s.order); i++ {
					if compareIDs(s.order[i-1], s.order[i]) > 0 {
						t.Fatalf("lows served out of order: %s before %s", s.order[i-1], s.order[i])
					}
				}
				s.checkOnce(rule, 120)
				t.Logf("120 callers: %d servings, %d script calls", s.serves, s.calls.Load())
			})
		})
	}
}

// TestLinePriorityAgeBound fills the line of a 10/s subject with 30
// callers of priority 0, then callers of priority 2 join at 12 a second,
// more than the limit, for 30 seconds. Without an age bound the lows would
// wait until the highs stop; with MaxAge 5s, no low is served between the
// first second (the turns booked before the highs came) and its age bound,
// and every low is admitted within its age bound plus the time to serve
// the lows promoted with it (30 at 10/s) and a horizon. Each caller is
// admitted once, the bound holds in every window, calls per caller flat.
func TestLinePriorityAgeBound(t *testing.T) {
	rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, rule)
		warm(t, l)
		s := newLineSim(t, rdb, l, time.Second)
		s.prio, s.maxAge = highFirst, 5*time.Second
		start := time.Now()
		for i := range 30 {
			s.admit(fmt.Sprintf("L%04d", i))
		}
		highs := 0
		for ; highs < 360; highs++ {
			s.runTo(start.Add(time.Duration(highs+1) * time.Second / 12))
			s.admit(fmt.Sprintf("H%04d", highs))
		}
		s.run(nil)
		var lastLow time.Duration
		for i := range 30 {
			at := s.admits[fmt.Sprintf("L%04d", i)].Sub(start)
			if at > 1500*ms && at < 5*time.Second-time.Second {
				t.Errorf("L%04d admitted at %v: before its age bound (5s) less a horizon, while younger highs waited", i, at)
			}
			lastLow = max(lastLow, at)
		}
		if bound := 5*time.Second + 3*time.Second + time.Second; lastLow > bound {
			t.Errorf("the last low admitted at %v; want within its age bound, 30 turns at 10/s and a horizon: %v", lastLow, bound)
		}
		s.checkOnce(rule, 30+highs)
		t.Logf("%d callers: last low at %v, %d servings, %d script calls", 30+highs, lastLow, s.serves, s.calls.Load())
	})
}

// TestPriorityErrors: a priority out of 0 to 9, a negative or fractional
// MaxAge and a priority with a share limit are refused before any call.
func TestPriorityErrors(t *testing.T) {
	{
		rdb := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
		l := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10)})
		t.Cleanup(func() { l.Close(); rdb.Close() })
		calls := countScripts(rdb)
		for _, tc := range []struct {
			name string
			req  AdmitRequest
			want string
		}{
			{"priority 10", AdmitRequest{Caller: Caller{Priority: 10}}, "priority 10: must be between 0 and 9"},
			{"priority -1", AdmitRequest{Caller: Caller{Priority: -1}}, "priority -1"},
			{"max age -1s", AdmitRequest{MaxAge: -time.Second}, "max age -1s"},
			{"max age 1ns", AdmitRequest{MaxAge: 1}, "whole number of microseconds"},
			{"share limit", AdmitRequest{Caller: Caller{Priority: 1}, ShareLimit: PerSecond(1)}, "a share limit and a priority cannot be combined"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				tc.req.Subject, tc.req.N, tc.req.Horizon, tc.req.ID = "acct", 1, time.Second, "x"
				_, err := l.Admit(t.Context(), tc.req)
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "throttle: ") {
					t.Errorf("Admit: %v; want an error with %q", err, tc.want)
				}
			})
		}
		if n := calls.Load(); n != 0 {
			t.Errorf("%d script calls for refused requests, want 0", n)
		}
	}
}
