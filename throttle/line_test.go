package throttle

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// lineSim drives callers through Admit with a horizon as a worker fleet
// would, on virtual time: every caller arrives at once, a booked one comes
// back at its slot, one in line comes back when a serving of the line
// hands it a turn, and the line is served whenever an Admission says so.
type lineSim struct {
	t       *testing.T
	lim     *Limiter
	horizon time.Duration
	share   func(id string) string
	weight  func(id string) int
	cap     Limit               // AdmitRequest.ShareLimit
	prio    func(id string) int // Caller.Priority; nil: 0
	maxAge  time.Duration       // AdmitRequest.MaxAge
	inLine  map[string]bool     // ids that joined the line

	returns map[string]time.Time // id -> when it comes back (Redis clock = local, virtual)
	serve   time.Time            // when the line is next served; zero if no one asked
	admits  map[string]time.Time // id -> its admission (the slot it ran on)
	order   []string             // ids in the order they were handed a turn from the line
	serves  int
	calls   *redistest.ScriptCalls
	maxLead time.Duration // the furthest ahead of its serving a handed slot was
	// late, if not nil, is how long after its turn a booked caller comes
	// back (0: at its turn), asked once per turn.
	late func(id string) time.Duration
	// costs, if not nil, are each caller's costs per rule (AdmitRequest.Costs)
	// in place of N = 1.
	costs Costs
}

func newLineSim(t *testing.T, rdb *redis.Client, lim *Limiter, horizon time.Duration) *lineSim {
	return &lineSim{t: t, lim: lim, horizon: horizon, returns: map[string]time.Time{}, admits: map[string]time.Time{},
		share: func(string) string { return "" }, weight: func(string) int { return 1 },
		inLine: map[string]bool{}, calls: countScripts(rdb)}
}

// lateOnce makes every nth task (by the number in its ID, "task-%d") come
// back late by d for its first turn only, so that turn lapses; it returns
// the set of the tasks it made late.
func (s *lineSim) lateOnce(every int, d time.Duration) map[string]bool {
	lapsed := map[string]bool{}
	s.late = func(id string) time.Duration {
		var i int
		fmt.Sscanf(id, "task-%d", &i)
		if i%every != 0 || lapsed[id] {
			return 0
		}
		lapsed[id] = true
		return d
	}
	return lapsed
}

func (s *lineSim) admit(id string) {
	s.t.Helper()
	c := Caller{ID: id, Share: s.share(id), Weight: s.weight(id)}
	if s.prio != nil {
		c.Priority = s.prio(id)
	}
	req := AdmitRequest{Subject: "acct", N: 1, Caller: c, Horizon: s.horizon, ShareLimit: s.cap, MaxAge: s.maxAge, Tolerance: 50 * ms}
	if s.costs != nil {
		req.N, req.Costs = 0, s.costs
	}
	a, err := s.lim.Admit(context.Background(), req)
	if err != nil {
		s.t.Fatalf("Admit %s: %v", id, err)
	}
	switch {
	case a.Status == Granted || a.Status == Redeemed:
		if _, dup := s.admits[id]; dup {
			s.t.Fatalf("%s admitted twice", id)
		}
		if a.Delay > 0 {
			time.Sleep(a.Delay)
		}
		s.admits[id] = time.Now()
		delete(s.returns, id)
	case a.Status == Booked && a.InLine:
		s.inLine[id] = true
		s.returns[id] = a.At // the fallback: a handed turn moves it earlier
		if !a.Serve.IsZero() && (s.serve.IsZero() || a.Serve.Before(s.serve)) {
			s.serve = a.Serve
		}
	case a.Status == Booked || a.Status == Held:
		if a.Delay > s.horizon+ms {
			s.t.Fatalf("%s booked %v ahead, past the horizon %v", id, a.Delay, s.horizon)
		}
		s.returns[id] = a.At
		if a.Status == Booked {
			s.returns[id] = a.At.Add(s.lateBy(id))
		}
	default:
		s.t.Fatalf("Admit %s: %+v", id, a)
	}
}

// lateBy is how late id comes back for the turn just booked for it.
func (s *lineSim) lateBy(id string) time.Duration {
	if s.late == nil {
		return 0
	}
	return s.late(id)
}

// serveLine serves the line once, as a worker's wake-up loop does.
func (s *lineSim) serveLine() {
	s.t.Helper()
	s.serves++
	a, err := s.lim.Admit(context.Background(), AdmitRequest{Subject: "acct", N: 0, Horizon: s.horizon, ShareLimit: s.cap})
	if err != nil {
		s.t.Fatalf("serving the line: %v", err)
	}
	now := time.Now()
	var got []string
	for id, slot := range a.Handed {
		if lead := slot.Sub(now); lead > s.maxLead {
			s.maxLead = lead
		}
		s.returns[id] = slot.Add(s.lateBy(id))
		got = append(got, id)
	}
	// Handed in slot order (ties by id, which is arrival order here).
	slices.SortFunc(got, func(x, y string) int {
		if c := a.Handed[x].Compare(a.Handed[y]); c != 0 {
			return c
		}
		return compareIDs(x, y)
	})
	s.order = append(s.order, got...)
	s.serve = time.Time{}
	if a.Status == Booked {
		s.serve = a.Serve
	}
}

func compareIDs(x, y string) int {
	var a, b int
	fmt.Sscanf(x[len(x)-4:], "%d", &a)
	fmt.Sscanf(y[len(y)-4:], "%d", &b)
	return a - b
}

// next returns the next event: when, and the id that comes back then, or
// "" for a serving of the line; a zero time if nothing is left.
func (s *lineSim) next() (time.Time, string) {
	next, id := s.serve, ""
	for i, at := range s.returns {
		if next.IsZero() || at.Before(next) || (at.Equal(next) && id != "" && compareIDs(i, id) < 0) {
			next, id = at, i
		}
	}
	return next, id
}

// step sleeps until the event at next and processes it.
func (s *lineSim) step(next time.Time, id string) {
	time.Sleep(time.Until(next))
	if id == "" {
		s.serveLine()
		return
	}
	s.admit(id)
}

// run processes returns and servings in time order until nobody waits.
func (s *lineSim) run(until func() bool) {
	s.t.Helper()
	for len(s.returns) > 0 || !s.serve.IsZero() {
		if until != nil && until() {
			return
		}
		s.step(s.next())
	}
}

// TestLineBacklog queues 200 callers of one subject at one instant under
// each algorithm at 10/s with a 1 s horizon: the turns within the horizon
// are booked, the rest wait in the line, charged nothing; servings of the
// line book each member's turn no further than the horizon ahead, in
// arrival order; every caller is admitted once, never more than the rule's
// bound in a window; and the calls per caller stay flat: one to join, one
// to redeem, plus one serving per half horizon for the whole line.
func TestLineBacklog(t *testing.T) {
	for _, rule := range admitRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, rule)
				warm(t, l)
				s := newLineSim(t, rdb, l, time.Second)
				const n = 200
				start := time.Now()
				for i := range n {
					s.admit(fmt.Sprintf("task-%04d", i))
				}
				inLine := len(s.inLine)
				if bound := windowBound(rule) + 12; n-inLine > bound {
					t.Errorf("%d of %d callers hold a turn at once, want at most %d (a horizon's worth)", n-inLine, n, bound)
				}
				if s.serve.IsZero() {
					t.Fatal("no caller was told to serve the line")
				}
				s.run(nil)
				if len(s.admits) != n {
					t.Fatalf("%d of %d callers admitted", len(s.admits), n)
				}
				var starts []time.Time
				for _, at := range s.admits {
					starts = append(starts, at)
				}
				if got, bound := redistest.MaxInWindow(starts, rule.Limit.Period), windowBound(rule); got > bound {
					t.Errorf("%d admissions in one period, bound %d", got, bound)
				}
				if s.maxLead > time.Second+ms {
					t.Errorf("a serving booked a turn %v ahead, past the 1s horizon", s.maxLead)
				}
				// The line is served in arrival order.
				for i := 1; i < len(s.order); i++ {
					if compareIDs(s.order[i-1], s.order[i]) > 0 {
						t.Fatalf("line served out of order: %s before %s", s.order[i-1], s.order[i])
					}
				}
				last := time.Duration(0)
				for _, at := range s.admits {
					last = max(last, at.Sub(start))
				}
				if lo, hi := 19*time.Second, 21*time.Second; last < lo || last > hi {
					t.Errorf("the last of %d at 10/s admitted after %v, want within [%v, %v]", n, last, lo, hi)
				}
				// Calls: n joins or bookings, n redemptions, the servings.
				if calls, want := s.calls.Load(), int64(2*n+s.serves); calls > want {
					t.Errorf("%d script calls for %d callers and %d servings, want at most %d", calls, n, s.serves, want)
				}
				if s.serves > n/5+4 {
					t.Errorf("%d servings for %d callers at 10/s: want about one per half second", s.serves, n)
				}
				t.Logf("%d callers: %d servings, %d script calls, last admitted at %v", n, s.serves, s.calls.Load(), last)
			})
		})
	}
}

// TestLineFairShares fills the line of one 10/s subject with share A's 100
// callers, then B's and C's 10 each: from the next serving on, B and C are
// served in turn with A, a third of the turns each, and A takes what is
// left once they are done; a share with weight 2 gets two turns for one.
func TestLineFairShares(t *testing.T) {
	for _, weighted := range []bool{false, true} {
		t.Run(fmt.Sprintf("weighted=%v", weighted), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
				s := newLineSim(t, rdb, l, time.Second)
				s.share = func(id string) string { return id[:1] }
				s.weight = func(id string) int {
					if weighted && id[0] == 'B' {
						return 2
					}
					return 1
				}
				admitW := s.admit
				for i := range 100 {
					admitW(fmt.Sprintf("A%04d", i))
				}
				s.run(func() bool { return len(s.order) > 0 })
				for i := range 10 {
					admitW(fmt.Sprintf("B%04d", i))
					admitW(fmt.Sprintf("C%04d", i))
				}
				mark := len(s.order)
				s.run(nil)
				counts := map[byte]int{}
				for _, id := range s.order[mark : mark+15] {
					counts[id[0]]++
				}
				wantB, wantC := 4, 4
				if weighted {
					wantB, wantC = 7, 3 // 2 : 1 : 1 of 15, rounded down
				}
				if counts['B'] < wantB || counts['C'] < wantC {
					t.Errorf("of the 15 turns after B and C joined: A %d, B %d, C %d; want B ≥ %d, C ≥ %d", counts['A'], counts['B'], counts['C'], wantB, wantC)
				}
				// A's and each share's turns stay in order.
				for i := 1; i < len(s.order); i++ {
					if s.order[i][0] == s.order[i-1][0] && compareIDs(s.order[i-1], s.order[i]) > 0 {
						t.Fatalf("share %c served out of order: %s before %s", s.order[i][0], s.order[i-1], s.order[i])
					}
				}
				if len(s.admits) != 120 {
					t.Errorf("%d of 120 admitted", len(s.admits))
				}
			})
		})
	}
}

// TestLineLiveChange drains a backlog at 10/s, then hands it to a limiter
// whose same rule allows 50/s (a reloaded rules file): the turns already
// booked are kept, and from a horizon after the change on the turns come
// at the new rate.
func TestLineLiveChange(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
		s := newLineSim(t, rdb, mustNew(t, rdb, Options{}, rule), time.Second)
		for i := range 300 {
			s.admit(fmt.Sprintf("task-%04d", i))
		}
		start := time.Now()
		s.run(func() bool { return time.Since(start) >= 5*time.Second })
		change := time.Now()
		rule.Limit = PerSecond(50).WithBurst(1)
		s.lim = mustNew(t, rdb, Options{}, rule)
		s.run(nil)
		if len(s.admits) != 300 {
			t.Fatalf("%d of 300 admitted", len(s.admits))
		}
		var before, after []time.Time
		for _, at := range s.admits {
			switch {
			case at.Before(change):
				before = append(before, at)
			case at.After(change.Add(1100 * ms)):
				after = append(after, at)
			}
		}
		if got := redistest.MaxInWindow(before, time.Second); got > 11 {
			t.Errorf("%d admitted in one second before the change, bound 11", got)
		}
		slices.SortFunc(after, time.Time.Compare)
		if len(after) < 100 {
			t.Fatalf("only %d admitted more than 1.1s after the change", len(after))
		}
		span := after[len(after)-1].Sub(after[0])
		if rate := float64(len(after)-1) / span.Seconds(); rate < 45 || rate > 51 {
			t.Errorf("%.1f/s from 1.1s after the change to 50/s, want about 50", rate)
		}
	})
}

// TestLineShareLimits runs one subject at 50/s (an API key) whose shares
// (tenants) are each limited to 10/s by AdmitRequest.ShareLimit, on
// virtual time: no share ever passes its own limit nor the key its limit
// in any second; a share alone runs at its own limit, not the key's; two
// busy shares run at their limits side by side, and a third that arrives
// behind their backlogs is not held behind them; eight busy shares split
// the key's 50/s; every caller is admitted once; and the script calls stay
// two per caller plus one serving per half horizon, whatever the backlog
// and whichever limit binds (every share asleep, the first is booked ahead
// for when its own limit admits it).
func TestLineShareLimits(t *testing.T) {
	key := Rule{Name: "key", Algorithm: GCRA, Limit: PerSecond(50).WithBurst(1)}
	cap := PerSecond(10).WithBurst(1)
	cases := []struct {
		name   string
		shares map[string]int // share -> callers
		late   map[string]int // share -> callers arriving 2 s later
		rate   map[string]float64
	}{
		{"alone", map[string]int{"A": 100}, nil, map[string]float64{"A": 10}},
		{"two-and-a-late-one", map[string]int{"A": 100, "B": 100}, map[string]int{"C": 20}, map[string]float64{"A": 10, "B": 10, "C": 10}},
		{"eight", map[string]int{"A": 60, "B": 60, "C": 60, "D": 60, "E": 60, "F": 60, "G": 60, "H": 60}, nil,
			map[string]float64{"A": 50.0 / 8, "B": 50.0 / 8, "C": 50.0 / 8, "D": 50.0 / 8, "E": 50.0 / 8, "F": 50.0 / 8, "G": 50.0 / 8, "H": 50.0 / 8}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, key)
				s := newLineSim(t, rdb, l, time.Second)
				s.share = func(id string) string { return id[:1] }
				s.cap = cap
				total := 0
				queue := func(shares map[string]int) {
					names := slices.Sorted(maps.Keys(shares))
					for i := range slices.Max(slices.Collect(maps.Values(shares))) {
						for _, sh := range names {
							if i < shares[sh] {
								s.admit(fmt.Sprintf("%s%04d", sh, i))
								total++
							}
						}
					}
				}
				start := time.Now()
				queue(tc.shares)
				lateAt := start.Add(2 * time.Second)
				if tc.late != nil {
					s.run(func() bool { return !time.Now().Before(lateAt) })
					time.Sleep(time.Until(lateAt))
					queue(tc.late)
				}
				s.run(nil)
				if len(s.admits) != total {
					t.Fatalf("%d of %d callers admitted", len(s.admits), total)
				}
				byShare := map[string][]time.Time{}
				var all []time.Time
				for id, at := range s.admits {
					byShare[id[:1]] = append(byShare[id[:1]], at)
					all = append(all, at)
				}
				if got := redistest.MaxInWindow(all, time.Second); got > 51 {
					t.Errorf("%d admitted in one second, the key allows 50 (+1 at the edges)", got)
				}
				for sh, ats := range byShare {
					if got := redistest.MaxInWindow(ats, time.Second); got > 11 {
						t.Errorf("share %s: %d admitted in one second, its limit is 10 (+1 at the edges)", sh, got)
					}
					slices.SortFunc(ats, time.Time.Compare)
					first := start
					if tc.late[sh] > 0 {
						first = lateAt
					}
					if wait := ats[0].Sub(first); wait > 1100*ms {
						t.Errorf("share %s: first admitted %v after it came, want within 1.1s", sh, wait)
					}
					rate := float64(len(ats)-1) / ats[len(ats)-1].Sub(ats[0]).Seconds()
					if want := tc.rate[sh]; rate < 0.9*want || rate > 1.05*want+0.5 {
						t.Errorf("share %s: %d admitted at %.2f/s, want about %.2f/s", sh, len(ats), rate, want)
					}
				}
				// Calls: one to join or book, one to redeem, the servings.
				if calls, want := s.calls.Load(), int64(2*total+s.serves); calls > want {
					t.Errorf("%d script calls for %d callers and %d servings, want at most %d", calls, total, s.serves, want)
				}
				span := time.Since(start)
				if max := int(span/(400*ms)) + 8; s.serves > max {
					t.Errorf("%d servings in %v: want about one per half horizon (at most %d)", s.serves, span, max)
				}
				t.Logf("%d callers in %v: %d servings, %d script calls", total, span.Round(ms), s.serves, s.calls.Load())
			})
		})
	}
}

// TestShareLimitErrors: a share limit needs a horizon, an ID, a valid
// limit, rules of the bucket algorithms, and N within its burst.
func TestShareLimitErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "key", Algorithm: GCRA, Limit: PerSecond(50)})
		ctx := context.Background()
		req := AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: "t1", Share: "a"}, Horizon: time.Second, ShareLimit: PerSecond(10).WithBurst(2)}
		if _, err := l.Admit(ctx, req); err != nil {
			t.Fatalf("a valid share limit: %v", err)
		}
		bad := req
		bad.N = 3
		if _, err := l.Admit(ctx, bad); !errors.Is(err, ErrExceedsCapacity) {
			t.Errorf("N 3 over a share limit of burst 2: %v, want ErrExceedsCapacity", err)
		}
		bad = req
		bad.ID = ""
		if _, err := l.Admit(ctx, bad); err == nil || !strings.Contains(err.Error(), "needs an ID") {
			t.Errorf("a share limit without an ID: %v", err)
		}
		bad = req
		bad.Horizon = 0
		if _, err := l.Admit(ctx, bad); err == nil || !strings.Contains(err.Error(), "needs a Horizon") {
			t.Errorf("a share limit without a horizon: %v", err)
		}
		window := mustNew(t, rdb, Options{}, Rule{Name: "win", Algorithm: SlidingWindow, Limit: PerSecond(50)})
		if _, err := window.Admit(ctx, req); err == nil || !strings.Contains(err.Error(), "needs limits of gcra or token_bucket") {
			t.Errorf("a share limit over a sliding window: %v", err)
		}
		bad = req
		bad.ShareLimit = Limit{Count: 10}
		if _, err := l.Admit(ctx, bad); err == nil || !strings.Contains(err.Error(), "period") {
			t.Errorf("a share limit without a period: %v", err)
		}
	})
}

// TestLinePerRules: two limiters over one subject with rules of their own
// (two task types, each with its own limit) each have a line: a serving by
// one books only its own members, charged to its own rules, and the other's
// members wait for their own rules' servings.
func TestLinePerRules(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		fast := mustNew(t, rdb, Options{}, Rule{Name: "fast", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)})
		slow := mustNew(t, rdb, Options{}, Rule{Name: "slow", Algorithm: GCRA, Limit: Limit{Count: 1, Period: time.Hour, Burst: 1}})
		admit := func(l *Limiter, id string) Admission {
			t.Helper()
			a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Horizon: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		if a := admit(slow, "s1"); a.Status != Granted {
			t.Fatalf("s1: %+v", a)
		}
		if a := admit(slow, "s2"); !a.InLine {
			t.Fatalf("s2: %+v; want in the slow rule's line (next turn in an hour)", a)
		}
		if a := admit(fast, "f1"); a.Status != Granted {
			t.Fatalf("f1: %+v; want granted: the slow rule's line is not the fast one's", a)
		}
		s, err := fast.Admit(ctx, AdmitRequest{Subject: "acct", Horizon: time.Second})
		if err != nil || len(s.Handed) != 0 || s.Status != Denied {
			t.Fatalf("the fast rule's serving: %+v, %v; want nothing handed (s2 waits for the slow rule)", s, err)
		}
		s, err = slow.Admit(ctx, AdmitRequest{Subject: "acct", Horizon: 2 * time.Hour})
		if _, ok := s.Handed["s2"]; err != nil || !ok {
			t.Fatalf("the slow rule's serving: %+v, %v; want s2 handed", s, err)
		}
		if d := s.Handed["s2"].Sub(time.Now()); d < 59*time.Minute {
			t.Errorf("s2 handed a turn in %v, want an hour: its own rule's", d)
		}
	})
}

// TestServeLine serves a line of 30 callers of a 10/s GCRA subject with a
// 1s horizon through ServeLine alone: each serving hands only turns within
// the horizon, in arrival order, says when to serve next while callers
// remain with how many (Waiting), and the line is empty, Next zero and
// Waiting 0, once every caller is handed a turn. A horizon of zero is an error, and a limiter with a Concurrency
// rule has no line.
func TestServeLine(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		warm(t, l)
		const n = 30
		for i := range n {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: fmt.Sprintf("task-%02d", i)}, Horizon: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if i > 10 && !a.InLine {
				t.Fatalf("caller %d: %+v, want in line past the horizon", i, a)
			}
		}
		handed := map[string]time.Time{}
		for servings := 0; ; servings++ {
			if servings > 2*n {
				t.Fatalf("%d servings and the line is not empty: %d of %d handed", servings, len(handed), n)
			}
			ls, err := l.ServeLine(ctx, "acct", time.Second, Limit{})
			if err != nil {
				t.Fatal(err)
			}
			now := time.Now()
			for id, slot := range ls.Handed {
				if lead := slot.Sub(now); lead > time.Second+ms {
					t.Fatalf("%s handed a turn %v ahead, past the 1s horizon", id, lead)
				}
				if _, dup := handed[id]; dup {
					t.Fatalf("%s handed twice", id)
				}
				handed[id] = slot
			}
			if left := n - 11 - len(handed); ls.Waiting != left {
				t.Fatalf("serving %d: Waiting %d, want the %d still in line", servings, ls.Waiting, left)
			}
			if ls.Next.IsZero() {
				if ls.Waiting != 0 {
					t.Fatalf("line empty, Waiting %d, want 0", ls.Waiting)
				}
				break
			}
			time.Sleep(max(ls.Next.Sub(time.Now()), ms))
		}
		inLine := n - 11 // the first 11 took turns within the horizon
		if len(handed) < inLine {
			t.Fatalf("%d handed, want at least the %d that waited in line", len(handed), inLine)
		}
		ids := slices.Collect(maps.Keys(handed))
		slices.SortFunc(ids, func(x, y string) int { return handed[x].Compare(handed[y]) })
		if !slices.IsSortedFunc(ids, compareIDs) {
			t.Errorf("handed out of arrival order: %v", ids)
		}
		if _, err := l.ServeLine(ctx, "acct", 0, Limit{}); err == nil {
			t.Error("ServeLine with no horizon: nil error, want one")
		}
		c := mustNew(t, rdb, Options{}, Rule{Name: "c", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: time.Minute}})
		if _, err := c.ServeLine(ctx, "acct", time.Second, Limit{}); err == nil {
			t.Error("ServeLine of a concurrency limiter: nil error, want one")
		}
	})
}

// Options.Line names a limiter's line: two limiters over one rule keep a
// line each, both booking the rule's turns.
func TestLineNamed(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(1).WithBurst(1)}
		plain := mustNew(t, rdb, Options{Prefix: "p:"}, rule)
		named := mustNew(t, rdb, Options{Prefix: "p:", Line: "key rule"}, rule)
		for i, l := range []*Limiter{plain, plain, named} {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: fmt.Sprint("c", i)}, Horizon: 500 * ms})
			if err != nil {
				t.Fatal(err)
			}
			if i > 0 && !a.InLine {
				t.Fatalf("caller %d: %+v, want in line (the rule's next turn is a second away)", i, a)
			}
		}
		for _, k := range []string{"p:{s}:!line(r)", "p:{s}:!line(key%20rule)"} {
			if n, _ := m.ZMembers(k); len(n) != 1 {
				t.Errorf("line %s: members %q, want one", k, n)
			}
		}
		if _, err := New(rdb, Options{Line: strings.Repeat("x", 257)}, rule); err == nil {
			t.Error("a line name of 257 bytes: no error")
		}
	})
}
