package throttle

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// admitRules are one rule of each algorithm at 10 per second (burst 1 for
// the buckets), so that the bound on admissions in any window of one period
// is 10 (+1 for a bucket's burst, as x/time/rate counts it).
var admitRules = []Rule{
	{Name: "fw", Algorithm: FixedWindow, Limit: Limit{Count: 10, Period: time.Second}},
	{Name: "sl", Algorithm: SlidingLog, Limit: Limit{Count: 10, Period: time.Second}},
	{Name: "sw", Algorithm: SlidingWindow, Limit: Limit{Count: 10, Period: time.Second}, Precision: 100 * ms},
	{Name: "tb", Algorithm: TokenBucket, Limit: PerSecond(10).WithBurst(1)},
	{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
}

// windowBound is the most permits a rule may admit in any window of its
// period: its count, plus its burst for the buckets.
func windowBound(r Rule) int {
	if r.Algorithm.bucket() {
		return r.Limit.Count + r.Limit.Burst
	}
	return r.Limit.Count
}

// TestAdmitBacklog books a backlog of 100 callers at one instant under each
// algorithm, then brings each back at its slot: the first is granted, the
// others (past the window's count or the bucket's burst) booked in arrival order; every booking redeems once, at its slot,
// with no second charge; and the slots, taken as admission times, never
// put more than the rule's bound in any window of one period. Each
// decision is one script call.
func TestAdmitBacklog(t *testing.T) {
	for _, rule := range admitRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, rule)
				warm(t, l)
				calls := countScripts(rdb)
				const n = 100
				immediate := rule.Limit.Count // admitted at once: a window's count, a bucket's burst
				if rule.Algorithm.bucket() {
					immediate = rule.Limit.Burst
				}
				start := time.Now()
				var starts []time.Time
				slots := map[string]time.Duration{}
				var order []string
				for i := range n {
					id := fmt.Sprintf("task-%03d", i)
					a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Wait: 0, Tolerance: 50 * ms})
					if err != nil {
						t.Fatalf("Admit %s: %v", id, err)
					}
					switch {
					case i < immediate && a.Status != Granted, i >= immediate && a.Status != Booked:
						t.Fatalf("Admit %s: status %v delay %v", id, a.Status, a.Delay)
					case a.Status == Granted:
						starts = append(starts, time.Now())
						continue
					}
					slots[id] = a.Delay
					order = append(order, id)
				}
				if got := calls.Load(); got != n {
					t.Errorf("%d admits sent %d script calls, want %d", n, got, n)
				}
				// Bookings are in arrival order.
				for i := 1; i < len(order); i++ {
					if slots[order[i]] < slots[order[i-1]] {
						t.Errorf("%s booked for %v, before %s at %v", order[i], slots[order[i]], order[i-1], slots[order[i-1]])
					}
				}
				// The ledger is full: a plain Allow now is denied.
				if res := allow(t, l, "acct", 1); res.Allowed {
					t.Errorf("Allow with %d booked ahead: admitted", n-immediate)
				}
				calls.Store(0)
				for _, id := range order {
					time.Sleep(time.Until(start.Add(slots[id])))
					a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Wait: 0, Tolerance: 50 * ms})
					if err != nil || a.Status != Redeemed || a.Delay != 0 {
						t.Fatalf("return of %s at its slot %v: %v, %+v; want redeemed now", id, slots[id], err, a)
					}
					starts = append(starts, time.Now())
				}
				if got, want := calls.Load(), int64(len(order)); got != want {
					t.Errorf("%d redemptions sent %d script calls, want %d", want, got, want)
				}
				if got, bound := redistest.MaxInWindow(starts, rule.Limit.Period), windowBound(rule); got > bound {
					t.Errorf("%d admissions in one period, bound %d", got, bound)
				}
				last := slots[order[len(order)-1]]
				if min, max := 9*time.Second, 10*time.Second+rule.precision(); last < min || last > max {
					t.Errorf("the 100th of 10/s booked for %v, want within [%v, %v]", last, min, max)
				}
				// Redeemed once: the same ID again takes a new turn.
				a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: order[0]}, Wait: -1, Tolerance: 50 * ms})
				if err != nil || a.Status != Granted {
					t.Errorf("second return of %s: %v, %v; want a new turn (granted)", order[0], a.Status, err)
				}
			})
		})
	}
}

// TestAdmitEarlyLate brings a booked caller back before its slot (held,
// or redeemed with the rest to wait if it can wait that long) and after it
// by more than the tolerance (a new turn: the stale slot is not redeemed).
func TestAdmitEarlyLate(t *testing.T) {
	for _, rule := range admitRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, rule)
				req := func(id string, wait time.Duration) AdmitRequest {
					return AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Wait: wait, Tolerance: 20 * ms}
				}
				// Fill the rule, then book one more.
				for i := range windowBound(rule) - rule.Limit.Burst {
					if a, err := l.Admit(ctx, req(fmt.Sprint("fill", i), -1)); err != nil || a.Status != Granted {
						t.Fatalf("fill %d: %v %v", i, a.Status, err)
					}
				}
				b, err := l.Admit(ctx, req("late", 0))
				if err != nil || b.Status != Booked || b.Delay <= 0 {
					t.Fatalf("booking: %+v, %v; want booked ahead", b, err)
				}
				slot := b.Delay
				// Early, unable to wait: held, booking kept, nothing charged.
				a, err := l.Admit(ctx, req("late", slot/2))
				if err != nil || a.Status != Held || a.Delay != slot {
					t.Fatalf("early return: %+v, %v; want held for %v", a, err, slot)
				}
				// Early, able to wait: redeemed, with the wait left.
				time.Sleep(slot / 2)
				a, err = l.Admit(ctx, req("late", slot))
				if err != nil || a.Status != Redeemed || a.Delay != slot-slot/2 {
					t.Fatalf("early return that can wait: %+v, %v; want redeemed in %v", a, err, slot-slot/2)
				}

				// Another booking, returned late by more than the tolerance.
				b, err = l.Admit(ctx, req("stale", 0))
				if err != nil || b.Status != Booked {
					t.Fatalf("second booking: %+v, %v", b, err)
				}
				time.Sleep(b.Delay + 21*ms)
				a, err = l.Admit(ctx, req("stale", -1))
				if err != nil || a.Status != Granted {
					t.Fatalf("late return: %+v, %v; want a new turn (granted)", a, err)
				}
			})
		})
	}
}

// TestAdmitReceiptAndHorizon redeems a receipt from PrepayN through Admit,
// puts a caller past the horizon in line without charging, and refuses a
// booking without an ID.
func TestAdmitReceiptAndHorizon(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)}
		l := mustNew(t, rdb, Options{}, rule)
		r, err := l.PrepayN(ctx, "s", 1, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		r2, err := l.PrepayN(ctx, "s", 1, time.Minute)
		if err != nil || r2.Delay() != 100*ms {
			t.Fatalf("second PrepayN: %v, %v", r2, err)
		}
		a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "job", Receipt: receiptOf(r2)}, Wait: time.Second, Tolerance: 10 * ms})
		if err != nil || a.Status != Redeemed || a.Delay != 100*ms {
			t.Fatalf("Admit with a receipt: %+v, %v; want redeemed in 100ms", a, err)
		}
		_ = r
		// The ledger is booked to 200ms: past a horizon of 150ms, a caller
		// without an ID is denied, one with an ID joins the line; neither
		// is charged. The line should be served when its head's turn is
		// half a horizon away.
		a, err = l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Wait: 0, Horizon: 150 * ms, Tolerance: 10 * ms})
		if err != nil || a.Status != Denied || a.Delay != 200*ms {
			t.Fatalf("past the horizon, no ID: %+v, %v; want denied, 200ms", a, err)
		}
		a, err = l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "far"}, Wait: 0, Horizon: 150 * ms, Tolerance: 10 * ms})
		if err != nil || a.Status != Booked || !a.InLine || time.Until(a.Serve) != 125*ms {
			t.Fatalf("past the horizon: %+v, %v; want in line, served in 125ms", a, err)
		}
		a, err = l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Wait: 50 * ms, Tolerance: 10 * ms})
		if err != nil || a.Status != Denied || a.Delay != 200*ms {
			t.Fatalf("no ID, past the wait: %+v, %v; want denied, 200ms", a, err)
		}
		if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 200*ms {
			t.Errorf("after denials: %+v; want denied for 200ms (nothing charged)", res)
		}
		if _, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "x"}, Tolerance: -ms}); err == nil {
			t.Error("Admit with a negative tolerance: no error")
		}
		if _, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 2, Caller: Caller{ID: "x"}, Tolerance: ms}); !errors.Is(err, ErrExceedsCapacity) {
			t.Errorf("Admit of 2 under burst 1: %v, want ErrExceedsCapacity", err)
		}
	})
}

// TestAdmitCancelRefunds checks that a granted turn's reservation refunds
// under every algorithm.
func TestAdmitCancelRefunds(t *testing.T) {
	for _, rule := range admitRules {
		t.Run(string(rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, rule)
				var last Admission
				for i := range windowBound(rule) - rule.Limit.Burst + 1 {
					a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: fmt.Sprint(i)}, Wait: -1, Tolerance: ms})
					if err != nil || a.Status != Granted {
						t.Fatalf("admit %d: %+v %v", i, a, err)
					}
					last = a
				}
				if last.Delay <= 0 {
					t.Fatalf("the turn after a full rule is due now")
				}
				before := allow(t, l, "s", 0+1)
				if before.Allowed {
					t.Fatalf("full rule admitted")
				}
				if err := last.Reservation.Cancel(ctx); err != nil {
					t.Fatal(err)
				}
				after, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "again"}, Wait: -1, Tolerance: ms})
				if err != nil || after.Delay > last.Delay {
					t.Errorf("after cancelling the turn at %v, the next is at %v; want no later", last.Delay, after.Delay)
				}
			})
		})
	}
}

// TestAdmitPauseDropsBookings pauses a subject (the upstream answered 429)
// while turns are booked: a booking whose turn falls inside the pause is not
// redeemed, its caller takes a new turn after the pause; one booked past
// the pause is redeemed as usual.
func TestAdmitPauseDropsBookings(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		req := func(id string, wait time.Duration) AdmitRequest {
			return AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Wait: wait, Tolerance: 50 * ms}
		}
		slots := map[string]time.Duration{}
		for i := range 10 {
			id := fmt.Sprint("t", i)
			a, err := l.Admit(ctx, req(id, 0))
			if err != nil {
				t.Fatal(err)
			}
			slots[id] = a.Delay
		}
		if slots["t3"] != 300*ms || slots["t9"] != 900*ms {
			t.Fatalf("slots %v; want 100ms apart", slots)
		}
		if _, err := l.PauseFor(ctx, "s", 500*ms); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * ms)
		// t3's turn (300ms) is inside the pause (until 500ms): a new turn,
		// after every booking already made.
		a, err := l.Admit(ctx, req("t3", 0))
		if err != nil || a.Status != Booked || a.Delay < 700*ms {
			t.Errorf("t3 at its turn inside the pause: %+v, %v; want a new turn after the others", a, err)
		}
		// t7's turn (700ms) is after the pause: held, then redeemed.
		time.Sleep(400 * ms)
		a, err = l.Admit(ctx, req("t7", 0))
		if err != nil || a.Status != Redeemed {
			t.Errorf("t7 at its turn after the pause: %+v, %v; want redeemed", a, err)
		}
	})
}

// Without a Tolerance, a booking is redeemed up to one interval of the
// tightest rule late (200ms at 5/s beside 100/min), and not later.
func TestAdmitDefaultTolerance(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{},
			Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(5).WithBurst(1)},
			Rule{Name: "slow", Algorithm: FixedWindow, Limit: Limit{Count: 100, Period: time.Minute}})
		for i, id := range []string{"first", "a", "b"} {
			want := []AdmitStatus{Granted, Booked, Booked}[i]
			if a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}}); err != nil || a.Status != want || a.Delay != time.Duration(i)*200*ms {
				t.Fatalf("Admit %s: %+v, %v; want status %s in %v", id, a, err, want, time.Duration(i)*200*ms)
			}
		}
		time.Sleep(400 * ms) // a is 200ms late: one interval
		if a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "a"}}); err != nil || a.Status != Redeemed {
			t.Fatalf("a, 200ms late: %+v, %v; want redeemed", a, err)
		}
		time.Sleep(201 * ms) // b is 201ms late
		if a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "b"}}); err != nil || a.Status == Redeemed {
			t.Fatalf("b, 201ms late: %+v, %v; want a new turn", a, err)
		}
		if _, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "c"}, Tolerance: -1}); err == nil {
			t.Fatal("a negative tolerance: no error")
		}
	})
}
