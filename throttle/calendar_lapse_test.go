package throttle

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// lapseRules are the policy of issue 24's calendar bench: 150 a second
// (GCRA, burst 1) and a daily quota of quota, UTC.
func lapseRules(quota int) []Rule {
	return []Rule{
		{Name: "second", Algorithm: GCRA, Limit: PerSecond(150).WithBurst(1)},
		{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: quota}, Calendar: Daily(nil)},
	}
}

// A backlog past a daily quota, parked in the line at 150/s: every fourth
// task comes back for its first turn later than its tolerance, so that
// turn lapses and it takes a new one. The lapsed turns give their units
// back to the quota: all of the day's quota is used, by each task once,
// and never more (issue 24: 116 of 3,000 were lost through real asynq).
func TestCalendarLapsedTurnsInLine(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		const quota, extra = 300, 30
		sleepUntil(t, time.Date(2000, 6, 3, 10, 0, 0, 0, time.UTC))
		l := mustNew(t, rdb, Options{}, lapseRules(quota)...)
		warm(t, l)
		s := newLineSim(t, rdb, l, time.Second)
		lapsed := s.lateOnce(4, 100*ms) // past lineSim's tolerance of 50ms
		start := time.Now()
		for i := range quota + extra {
			s.admit(fmt.Sprintf("task-%04d", i))
		}
		s.run(func() bool { return time.Since(start) > 30*time.Second })
		if len(lapsed) < quota/5 {
			t.Fatalf("%d turns lapsed; the test needs about %d", len(lapsed), quota/4)
		}
		if got := len(s.admits); got != quota {
			t.Errorf("%d tasks started today (%d turns lapsed), want the quota, %d", got, len(lapsed), quota)
		}
		var starts []time.Time
		for _, at := range s.admits {
			starts = append(starts, at)
		}
		if got := redistest.MaxInWindow(starts, time.Second); got > 151 {
			t.Errorf("%d started in one second, bound 151", got)
		}
		if res := allow(t, l, "acct", 1); res.Allowed || res.Rule != "daily" {
			t.Errorf("after the day's quota: %+v; want denied by the quota", res)
		}
	})
}

// Turns booked on day 1 into day 2 (day 1's quota spent) and redeemed
// late on day 2 count in day 2 once: their new turns reuse the lapsed
// turns' units, and day 2 admits its quota, no more.
func TestCalendarLapsedTurnsAcrossMidnight(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		const quota = 5
		ctx := context.Background()
		midnight := time.Date(2000, 6, 4, 0, 0, 0, 0, time.UTC)
		sleepUntil(t, midnight.Add(-time.Second))
		l := mustNew(t, rdb, Options{}, lapseRules(quota)...)
		perDay := map[string]int{}
		start := func() { perDay[time.Now().UTC().Format(time.DateOnly)]++ }
		for range quota {
			if !allow(t, l, "acct", 1).Allowed {
				t.Fatal("day 1: a permit of its quota denied")
			}
			start()
			time.Sleep(10 * ms)
		}
		req := func(id string) AdmitRequest {
			return AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Wait: 0}
		}
		for i := range quota {
			// At midnight, each a turn of 150/s after the last: the rate
			// rule is charged when the turn acts, not at its own earliest
			// (which would book all five at one instant).
			a, err := l.Admit(ctx, req(fmt.Sprint("task-", i)))
			want := midnight.Add(time.Duration(i) * time.Second / 150).Round(time.Microsecond)
			if err != nil || a.Status != Booked || a.Slot.Sub(want).Abs() > time.Microsecond {
				t.Fatalf("task-%d on day 1: %+v, %v; want booked at %v", i, a, err, want)
			}
		}
		// Every task comes back a second late, and until it runs, at its
		// turn.
		sleepUntil(t, midnight.Add(time.Second))
		for i := range quota {
			id := fmt.Sprint("task-", i)
			for {
				a, err := l.Admit(ctx, req(id))
				if err != nil {
					t.Fatalf("%s: %v", id, err)
				}
				if a.Status == Granted || a.Status == Redeemed {
					time.Sleep(a.Delay)
					start()
					break
				}
				if a.Status != Booked && a.Status != Held || a.Delay > time.Second {
					t.Fatalf("%s back on day 2: %+v; want a turn on day 2", id, a)
				}
				time.Sleep(a.Delay)
			}
		}
		if res := allow(t, l, "acct", 1); res.Allowed || res.Rule != "daily" {
			t.Errorf("day 2 after its quota: %+v; want denied by the quota", res)
		}
		if want := map[string]int{"2000-06-03": quota, "2000-06-04": quota}; fmt.Sprint(perDay) != fmt.Sprint(want) {
			t.Errorf("started per day %v; want %v", perDay, want)
		}
	})
}

// A booking whose turn falls inside a pause is not redeemed: it lapses,
// and its quota unit goes back for the caller's new turn after the pause.
func TestCalendarLapsedTurnInPause(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		sleepUntil(t, time.Date(2000, 6, 3, 10, 0, 0, 0, time.UTC))
		l := mustNew(t, rdb, Options{},
			Rule{Name: "second", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
			Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: 3}, Calendar: Daily(nil)})
		req := func(id string) AdmitRequest {
			return AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Wait: 0, Tolerance: 50 * ms}
		}
		for i, want := range []AdmitStatus{Granted, Booked, Booked} {
			if a, err := l.Admit(ctx, req(fmt.Sprint("t", i))); err != nil || a.Status != want {
				t.Fatalf("t%d: %+v, %v; want %v", i, a, err, want)
			}
		}
		if _, err := l.PauseFor(ctx, "acct", 250*ms); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * ms)
		a, err := l.Admit(ctx, req("t1"))
		if err != nil || a.Status != Booked || a.Delay < 150*ms || a.Delay > time.Second {
			t.Fatalf("t1 at its turn inside the pause: %+v, %v; want a new turn today, after the pause", a, err)
		}
		time.Sleep(a.Delay)
		if a, err := l.Admit(ctx, req("t1")); err != nil || a.Status != Redeemed {
			t.Fatalf("t1 at its new turn: %+v, %v; want redeemed", a, err)
		}
		// t2 never came back: its turn, in the pause too, lapsed with t1's
		// return, and its unit is the day's last.
		time.Sleep(time.Second)
		if res := allow(t, l, "acct", 1); !res.Allowed || res.Remaining != 0 {
			t.Errorf("t2's unit: %+v; want allowed, the quota's last", res)
		}
		time.Sleep(time.Second)
		if res := allow(t, l, "acct", 1); res.Allowed || res.Rule != "daily" {
			t.Errorf("after the quota: %+v; want denied by the quota", res)
		}
	})
}

// A Prepay receipt that lapses (never redeemed within its keep) gives its
// quota unit back when the next Prepay of the policy sees it; the producer
// that then cancels it (a failed enqueue slower than the keep) gives
// nothing back a second time: the day admits its quota, no more.
func TestCalendarLapsedReceiptCancelled(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		const quota = 3
		l := quotaAt10(t, rdb, quota)
		lapsed, err := l.PrepayN(ctx, "acct", 1, 100*ms)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * ms)
		if _, err := l.PrepayN(ctx, "acct", 1, 100*ms); err != nil { // sees the lapse: the unit comes back
			t.Fatal(err)
		}
		if err := lapsed.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		admitted := 1 // the second receipt
		for range quota + 2 {
			time.Sleep(200 * ms)
			if allow(t, l, "acct", 1).Allowed {
				admitted++
			}
		}
		if admitted != quota {
			t.Errorf("%d admitted today (a receipt among them); want the quota, %d", admitted, quota)
		}
	})
}

// A turn booked again (Rebook: a worker draining for shutdown) that its
// caller never redeems lapses and gives its quota unit back, like any
// booking: kept as long as the quota's window, not only until its slot
// and tolerance, so that the next Admit still finds it.
func TestCalendarLapsedRebookedTurn(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		const quota = 3
		l := quotaAt10(t, rdb, quota)
		req := func(id string) AdmitRequest {
			return AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id}, Wait: time.Second, Tolerance: 50 * ms}
		}
		started := 0
		if a, err := l.Admit(ctx, req("t0")); err != nil || a.Status != Granted {
			t.Fatalf("t0: %+v, %v; want granted", a, err)
		}
		started++
		a, err := l.Admit(ctx, req("t1"))
		if err != nil || a.Status != Granted || a.Delay <= 0 {
			t.Fatalf("t1: %+v, %v; want granted later", a, err)
		}
		if ok, err := a.Reservation.Rebook(ctx); !ok || err != nil {
			t.Fatalf("t1's Rebook: %v, %v; want booked", ok, err)
		}
		time.Sleep(time.Second) // t1 never comes back
		if a, err := l.Admit(ctx, req("t2")); err != nil || a.Status != Granted {
			t.Fatalf("t2: %+v, %v; want granted", a, err)
		}
		started++
		for range quota {
			time.Sleep(200 * ms)
			if allow(t, l, "acct", 1).Allowed {
				started++
			}
		}
		if started != quota {
			t.Errorf("%d started today, t1's booked turn lapsed; want the quota, %d", started, quota)
		}
	})
}

// quotaAt10 moves to 10:00 UTC and returns a limiter of 10 a second
// (GCRA, burst 1) and a daily quota of quota, UTC.
func quotaAt10(t *testing.T, rdb *redis.Client, quota int) *Limiter {
	sleepUntil(t, time.Date(2000, 6, 3, 10, 0, 0, 0, time.UTC))
	return mustNew(t, rdb, Options{},
		Rule{Name: "second", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)},
		Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: quota}, Calendar: Daily(nil)})
}
