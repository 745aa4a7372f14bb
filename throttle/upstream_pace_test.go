package throttle

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// A subject whose upstream taught a rate slower than its rule is admitted
// at the learned rate: a backlog of tasks parks once each, on turns spaced
// at the learned interval with no burst, from the next departure's slot
// on, so that a request sent on each turn departs at once; the rule's own
// pace comes back for a subject with nothing learned.
func TestAdmitPacedByLearnedRate(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(5)}
		lim := mustNew(t, rdb, Options{}, rule)
		u := lim.Upstream()
		first, _ := depart(t, u, "s", 0)
		learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
		iv := 52632 * time.Microsecond // 1/(95 % of 20/s), in whole µs up
		slots := func(subject string) []time.Duration {
			var got []time.Duration
			for i := range 6 {
				a, err := lim.Admit(ctx, AdmitRequest{Subject: subject, N: 1, Caller: Caller{ID: fmt.Sprintf("%s-%d", subject, i)}})
				if err != nil {
					t.Fatal(err)
				}
				if subject == "s" && i > 0 && a.Status != Booked {
					t.Fatalf("task %d of %s: %s; want booked (it parks)", i, subject, a.Status)
				}
				got = append(got, a.Delay)
			}
			return got
		}
		for i, d := range slots("s") {
			// The probe left at 0: the next departure's slot is iv.
			if want := time.Duration(i+1) * iv; d < want-2*time.Microsecond || d > want+2*time.Microsecond {
				t.Errorf("task %d's turn is %v away; want %v (one learned interval, 1/(95 %% of 20/s), apart, no burst)", i, d, want)
			}
		}
		// Coming back at its turn, a task redeems it: one park, two calls.
		time.Sleep(2 * iv)
		a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "s-1"}})
		if err != nil || a.Status != Redeemed {
			t.Fatalf("task 1 back at its turn: %+v, %v; want redeemed", a, err)
		}
		// Nothing learned for "t": the rule's burst of 5, then its 10ms.
		for i, d := range slots("t") {
			want := time.Duration(max(i-4, 0)) * 10 * time.Millisecond
			if d < want-2*time.Microsecond || d > want+2*time.Microsecond {
				t.Errorf("task %d of an unlearned subject: turn %v away; want %v (the rule's pace)", i, d, want)
			}
		}
	})
}

// lua/upstream_rate.lua grows a learned rate, and lua/upstream_learn.lua
// lowers it for a 429 alone, by the constants upstream.go documents.
func TestUpstreamRateConstants(t *testing.T) {
	src, err := luaFiles.ReadFile("lua/upstream_rate.lua")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`local up_below, up_recover, up_grow = ([0-9.]+), ([0-9.]+), ([0-9.]+)`).FindSubmatch(src)
	if m == nil {
		t.Fatal("lua/upstream_rate.lua does not set up_below, up_recover, up_grow")
	}
	for i, want := range []float64{learnBelow, learnRecover, learnGrow} {
		if got, _ := strconv.ParseFloat(string(m[i+1]), 64); got != want {
			t.Errorf("lua/upstream_rate.lua's constant %d is %v; upstream.go says %v", i, got, want)
		}
	}
	src, err = luaFiles.ReadFile("lua/upstream_learn.lua")
	if err != nil {
		t.Fatal(err)
	}
	m = regexp.MustCompile(`(?m)^local k_alone = ([0-9.]+)$`).FindSubmatch(src)
	if m == nil {
		t.Fatal("lua/upstream_learn.lua does not set k_alone")
	}
	if got, _ := strconv.ParseFloat(string(m[1]), 64); got != learnAlone {
		t.Errorf("lua/upstream_learn.lua's k_alone is %v; upstream.go's learnAlone says %v", got, learnAlone)
	}
}

// A caller that runs on a turn Admit decides at the learned rate takes
// its request's departure in the same call, on its own turn: the
// schedule's latest departure is that turn, and the next departure of any
// kind comes an interval after it. Turns booked at the rule's faster pace
// before the rate was learned are thinned, not chained: each departs at
// least an interval after the one before and at most an interval after
// its turn, or takes a new turn; so do the turns booked at the learned
// rate after them, and no departure drifts further behind its turn (a
// first version, d5ac1c3, chained them: every departure an interval after
// the latest, 0.8 s behind its turn in a 10-worker run). A task back late
// for its turn, with nobody departed within an interval, leaves at once.
func TestAdmitTurnIsDeparture(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)})
		u := lim.Upstream()
		iv := 52632 * time.Microsecond
		admit := func(id string) Admission {
			// A booking is honoured up to a second late (the worker's
			// tolerance is of that order).
			a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Tolerance: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		first, _ := depart(t, u, "s", 0)
		// Parked at the rule's pace (10ms) before the rate is learned.
		var ids []string
		turn := map[string]time.Time{}
		for i := range 5 {
			id := fmt.Sprintf("old-%d", i)
			if a := admit(id); a.Status == Booked {
				ids, turn[id] = append(ids, id), a.Slot
			}
		}
		learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
		for i := range 4 {
			id := fmt.Sprintf("new-%d", i)
			a := admit(id)
			if a.Status != Booked {
				t.Fatalf("%s: %s; want booked", id, a.Status)
			}
			ids, turn[id] = append(ids, id), a.Slot
		}
		parked := len(ids)
		// Each comes back at its turn, in turn order; one that must take a
		// new turn comes back at that one.
		var deps []time.Time
		reparked := 0
		for len(ids) > 0 {
			id := ids[0]
			ids = ids[1:]
			time.Sleep(time.Until(turn[id])) // Redis reads the bubble's clock
			a := admit(id)
			switch a.Status {
			case Redeemed, Granted:
				if lag := a.Slot.Sub(turn[id]); lag > iv {
					t.Errorf("%s departs %v after its turn; want at most one interval, %v", id, lag, iv)
				}
				deps = append(deps, a.Slot)
			case Booked:
				reparked++
				turn[id] = a.Slot
				ids = append(ids, id)
			default:
				t.Fatalf("%s back at its turn: %s", id, a.Status)
			}
		}
		slices.SortFunc(deps, func(a, b time.Time) int { return a.Compare(b) })
		for i := 1; i < len(deps); i++ {
			// The learned rate grows by 0.02 % a second.
			if gap := deps[i].Sub(deps[i-1]); gap < iv*999/1000 {
				t.Errorf("departures %d and %d are %v apart; want at least one learned interval, %v", i-1, i, gap, iv)
			}
		}
		if len(deps) != parked || reparked > parked-4 {
			t.Errorf("%d departures, %d turns taken again; want %d, at most %d (the old pace's)", len(deps), reparked, parked, parked-4)
		}
		if ls, _ := strconv.ParseInt(m.HGet(lim.policy.upstreamKey("s"), "ls"), 10, 64); ls != deps[len(deps)-1].UnixMicro() {
			t.Errorf("the schedule's latest departure is %d; want the last turn's, %d", ls, deps[len(deps)-1].UnixMicro())
		}
		// A departure of another kind comes an interval after the last
		// turn. (A first booking less than an interval after a turn,
		// while the rate is new, would be taken for the turn's own
		// request, late: TestDepartClaimsItsTurn; a re-booking claims
		// nothing.)
		time.Sleep(3 * time.Millisecond)
		d, err := u.book(context.Background(), u.keys("s"), 0, false, true)
		if err != nil {
			t.Fatal(err)
		}
		if got := d.At.Sub(deps[len(deps)-1]); got < iv-time.Millisecond || got > iv+time.Millisecond {
			t.Errorf("a departure booked after the turns leaves %v after the last; want %v", got, iv)
		}
		// Late by 20ms for a turn nobody departed near: it leaves now.
		time.Sleep(time.Until(d.At) + 2*iv)
		if y := admit("y"); y.Status != Granted {
			t.Fatalf("y: %s; want granted", y.Status)
		}
		x := admit("late")
		if x.Status != Booked {
			t.Fatalf("late: %s; want booked", x.Status)
		}
		time.Sleep(time.Until(x.At) + 20*time.Millisecond)
		if a := admit("late"); a.Status != Redeemed || a.Delay != 0 {
			t.Errorf("back 20ms late for a free turn: %s in %v; want redeemed, now", a.Status, a.Delay)
		}
	})
}

// lua/upstream_pace.lua keeps the upstream hash for UpstreamTTL.
func TestUpstreamPaceTTL(t *testing.T) {
	src, err := luaFiles.ReadFile("lua/upstream_pace.lua")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`local up_ttl = ([0-9]+)`).FindSubmatch(src)
	if m == nil || string(m[1]) != strconv.FormatInt(UpstreamTTL.Milliseconds(), 10) {
		t.Errorf("lua/upstream_pace.lua's up_ttl is %q; UpstreamTTL is %d ms", m, UpstreamTTL.Milliseconds())
	}
}

// A request sent late on its turn (less than an interval after it) from
// a process that does not know yet that Admit booked the turn as its
// departure still takes that departure, and leaves at once; the next
// turn's departure is pushed by its lateness. Before, it booked a slot
// after every turn (b's) and left its own as a hole: ten worker processes
// starting on two cores came 2-4 ms late for their first turns, and a
// 10-worker run's first second had four such holes.
func TestDepartClaimsItsTurnLate(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u, admit := newlyLearned(t, rdb)
		turn := parkAB(admit) // a, then b an interval later
		iv := turn["b"].Sub(turn["a"])
		late := 10 * time.Millisecond // past the tolerance, within the interval
		time.Sleep(time.Until(turn["a"]))
		if a := admit("a"); a.Status != Redeemed {
			t.Fatalf("a back at its turn: %s; want redeemed", a.Status)
		}
		time.Sleep(late)
		d, when := depart(t, u, "s", 0)
		if want := turn["a"].Add(late).Sub(epoch); when != want || d.Rebooked != 0 {
			t.Errorf("a's request, %v late, left at %v (rebooked %d); want at once, %v", late, when, d.Rebooked, want)
		}
		time.Sleep(time.Until(turn["b"]))
		if b := admit("b"); b.Status != Redeemed {
			t.Fatalf("b back at its turn: %s; want redeemed", b.Status)
		}
		if _, when := depart(t, u, "s", 0); (when - turn["a"].Add(late+iv).Sub(epoch)).Abs() > 100*time.Microsecond {
			t.Errorf("b's request left %v after its turn; want %v, pushed by a's lateness", when-turn["b"].Sub(epoch), late)
		}
	})
}

// A request sent on its turn from a process that does not know yet that
// Admit booked the turn as its departure (its process has not heard of
// the learned rate) departs on the schedule: Depart hands it that same
// departure, instead of a second slot that would leave the first a hole
// and take the next turn's (a 10-worker run lost 12 of the first 19
// slots so, and converged in 2.4–3.0 s). Only once: a second request
// near it gets a slot of its own (before the fix, the first did: b's
// turn, an interval later); and only while the rate is new: later,
// a request that departs on the schedule is late for its turn, or was
// turned at another pace, and the departure near it is someone else's.
func TestDepartClaimsItsTurn(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u, admit := newlyLearned(t, rdb)
		turn := parkAB(admit) // a, then b an interval later
		time.Sleep(time.Until(turn["a"]))
		if a := admit("a"); a.Status != Redeemed || !a.Slot.Equal(turn["a"]) {
			t.Fatalf("a back at its turn: %s at %v; want redeemed at its turn, %v", a.Status, a.Slot, turn["a"])
		}
		time.Sleep(time.Millisecond) // sent a little after its turn
		d, _ := depart(t, u, "s", 0)
		if got := d.slot; got != strconv.FormatInt(turn["a"].UnixMicro(), 10) {
			t.Errorf("a's request departs at %s; want its turn's departure, %d", got, turn["a"].UnixMicro())
		}
		if d2, _ := depart(t, u, "s", 0); d2.slot == d.slot {
			t.Errorf("a second request near a's turn departs at it too (%s); want a slot of its own", d2.slot)
		}
		// Long after the rate was learned, a departure near a turn is not
		// handed out.
		time.Sleep(4 * time.Second)
		a := admit("c")
		time.Sleep(time.Until(a.At))
		if d, _ := depart(t, u, "s", 0); d.slot == strconv.FormatInt(a.Slot.UnixMicro(), 10) {
			t.Errorf("4 s after the rate was learned, a request departs at a turn's departure (%s); want a slot of its own", d.slot)
		}
	})
}

// A lowering of the learned rate closes the departures Admit booked open
// at the old pace: a request that departs on the schedule near one that
// now lies closer than the new interval to the departure before it is
// handed a slot at the new pace, not that one. (A 3-worker header-less
// run claimed an open departure 36ms after the request before it, under
// the API's 50ms; its 429, counted at the new pace, pinned the rate at
// 75 % of the limit. Before the fix, b's request here departs at b's
// turn, 52.6ms after a's, under the new 58.5ms.)
func TestDepartClaimsNoTurnOfAnOldPace(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u, admit := newlyLearned(t, rdb)
		turn := map[string]time.Time{}
		for _, id := range []string{"a", "b"} {
			turn[id] = admit(id).Slot // both park, an interval (52.6ms) apart
		}
		// Both run on their turns while the rate is new: their
		// departures are booked open.
		for _, id := range []string{"a", "b"} {
			time.Sleep(time.Until(turn[id]))
			if a := admit(id); a.Status != Redeemed || !a.Slot.Equal(turn[id]) {
				t.Fatalf("%s back at its turn: %s at %v; want redeemed at its turn, %v", id, a.Status, a.Slot, turn[id])
			}
		}
		l := learn(t, u, "s", nil, Answer{TooMany: true})
		if !l.Lowered {
			t.Fatalf("a 429: %+v; want the rate lowered", l)
		}
		newIv := time.Duration(float64(time.Second) / l.Rate) // 58.5ms: 1/(90 % of 19/s)
		time.Sleep(time.Millisecond)                          // b's request, sent a little after its turn
		d, _ := depart(t, u, "s", 0)
		// (The rate grows by 0.02 % a second meanwhile.)
		if got := d.At.Sub(turn["b"]); got < newIv-10*time.Microsecond {
			t.Errorf("b's request departs %v after b's turn (slot %s); want a slot at the new pace, at least %v after every departure", got, d.slot, newIv)
		}
	})
}

// parkAB parks a, then b, on admit's learned schedule, and returns their
// turns.
func parkAB(admit func(id string) Admission) map[string]time.Time {
	turn := map[string]time.Time{}
	for _, id := range []string{"a", "b"} {
		turn[id] = admit(id).Slot
	}
	return turn
}

// newlyLearned returns the upstream of a limiter of 100/s whose subject
// "s" has just learned a policy of 20/s (a rate of 19/s, new: Admit books
// its turns' departures open), and a function that admits a caller of s
// with a second's tolerance for its booking.
func newlyLearned(t *testing.T, rdb *redis.Client) (*Upstream, func(id string) Admission) {
	t.Helper()
	lim := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)})
	u := lim.Upstream()
	first, _ := depart(t, u, "s", 0)
	learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
	return u, func(id string) Admission {
		a, err := lim.Admit(context.Background(), AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Tolerance: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
}

// lowering is a learned 20/s policy for subject s, eight tasks granted
// turns 1/19 s apart (each turn's departure booked, open for its request
// to claim: the rate is new), and the first task's request answered 429
// as it leaves on its turn.
type lowering struct {
	lim   *Limiter
	u     *Upstream
	turns []time.Duration // on at()'s clock
	left  time.Duration   // the 429's request's leave
	l     Lesson          // what the 429 taught
}

func lowerAfterTurns(t *testing.T, rdb *redis.Client) *lowering {
	t.Helper()
	lim := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)})
	w := &lowering{lim: lim, u: lim.Upstream()}
	first, _ := depart(t, w.u, "s", 0)
	learn(t, w.u, "s", first, Answer{Quota: 20, Window: time.Second})
	for i := range 8 {
		w.turns = append(w.turns, w.admit(t, i))
	}
	time.Sleep(w.turns[0] - at())
	var d *Departure
	d, w.left = depart(t, w.u, "s", 0)
	if w.l = learn(t, w.u, "s", d, Answer{TooMany: true}); !w.l.Lowered {
		t.Fatalf("the 429: %+v; want the rate lowered", w.l)
	}
	return w
}

// admit grants task i a turn and returns it, on at()'s clock.
func (w *lowering) admit(t *testing.T, i int) time.Duration {
	t.Helper()
	a, err := w.lim.Admit(context.Background(), AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: fmt.Sprintf("s-%d", i)}, Wait: 2 * time.Second})
	if err != nil || a.Status != Granted {
		t.Fatalf("task %d: %+v, %v; want granted", i, a, err)
	}
	return at() + a.Delay
}

// A 429 that lowers the learned rate forgets the departures booked at the
// faster pace: a turn's departure Admit booked can no longer be claimed at
// the slower interval, so its owner, coming at its turn, books again, and
// it was booked behind every one of them (traced under a policy at 10
// worker processes: eight turns' departures 52 ms apart, a 575 ms hole).
// It departs an interval, at the slower rate, after the latest leave.
func TestLoweringForgetsFasterDepartures(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		w := lowerAfterTurns(t, rdb)
		// The second task comes at its turn and departs: an interval at
		// the lowered rate after the first's leave, not after the turns.
		time.Sleep(w.turns[1] - at())
		start := time.Now()
		next, err := w.u.DepartPaced(context.Background(), "s", 0)
		if err != nil {
			t.Fatal(err)
		}
		if waited, iv := time.Since(start), time.Duration(float64(time.Second)/w.l.Rate); waited > iv {
			t.Errorf("the second task departed %v after its turn (the last turn %v after it); want within the lowered interval %v", waited, w.turns[7]-w.turns[1], iv)
		}
		if next.Rebooked > 1 {
			t.Errorf("the second task's departure was booked %d times more; want at most once", next.Rebooked)
		}
	})
}

// The owners of the turns a lowering forgot come back, one departure
// each: a turn Admit grants meanwhile is booked after the slots they will
// take, not among them (traced under a policy at 10 worker processes: a
// turn admitted 16 ms after a 429 was booked at the rule's next turn;
// three owners came back before it, two fitted, the third was booked
// behind it: a 92 ms hole).
func TestLoweringReservesForgottenTurns(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		w := lowerAfterTurns(t, rdb)
		// A ninth task is admitted 16 ms later, before the other seven come.
		time.Sleep(16 * time.Millisecond)
		turns := append(w.turns, w.admit(t, 8))
		leaves := []time.Duration{w.left}
		for i := 1; i < len(turns); i++ {
			if wait := turns[i] - at(); wait > 0 {
				time.Sleep(wait)
			}
			if _, err := w.u.DepartPaced(context.Background(), "s", 0); err != nil {
				t.Fatal(err)
			}
			leaves = append(leaves, at())
		}
		// Each an interval after the one before, none left empty (the
		// slots are reserved at the lowered rate, which recovers meanwhile:
		// the ninth task leaves a few ms more than an interval after the
		// eighth).
		iv := time.Duration(float64(time.Second) / w.l.Rate)
		for i := 1; i < len(leaves); i++ {
			if gap := leaves[i] - leaves[i-1]; gap >= iv*3/2 {
				t.Errorf("task %d left %v after task %d (leaves %v, turns %v); want an interval (%v at the lowered rate), no slot left empty", i, gap, i-1, leaves, turns, iv)
			}
		}
	})
}
