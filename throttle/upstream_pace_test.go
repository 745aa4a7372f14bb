package throttle

import (
	"context"
	"fmt"
	"regexp"
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

// lua/upstream_rate.lua grows a learned rate by the constants upstream.go
// documents.
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
}

// A caller that runs on a turn Admit decides at the learned rate takes
// its request's departure in the same call: the schedule's next departure
// comes an interval after it, and Learned.PacedFrom names the first.
// Parked tasks that come back late, in any order, depart an interval
// apart from now on, none parked again. A request too late for its
// departure departs again (DepartLate): at once if no departure was booked
// after it, else an interval after the latest.
func TestAdmitTurnIsDeparture(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)})
		u := lim.Upstream()
		first, _ := depart(t, u, "s", 0)
		learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
		iv := 52632 * time.Microsecond
		near := func(got, want time.Duration) bool { return got >= want*999/1000 && got <= want+2*time.Microsecond }
		admit := func(id string) Admission {
			// A booking is honoured up to a second late (the worker's
			// tolerance is of that order).
			a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Tolerance: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		// run admits id and, if it parks, redeems its turn when it comes.
		run := func(id string) Admission {
			a := admit(id)
			for a.Status == Booked || a.Status == Held {
				time.Sleep(time.Until(a.At))
				a = admit(id)
			}
			return a
		}
		a := run("a")
		d, _ := depart(t, u, "s", 0)
		if got := d.At.Sub(a.At); !near(got, iv) {
			t.Errorf("a departure booked after a's leaves %v after it; want one learned interval, %v", got, iv)
		}
		if !d.Learned.PacedFrom.Equal(a.Slot) {
			t.Errorf("PacedFrom %v; want a's departure %v, the first", d.Learned.PacedFrom, a.Slot)
		}
		// b and c park; both come back 30ms after c's turn, c first.
		b, c := admit("b"), admit("c")
		if b.Status != Booked || c.Status != Booked {
			t.Fatalf("b %s, c %s; want both booked", b.Status, c.Status)
		}
		time.Sleep(time.Until(c.At) + 30*time.Millisecond)
		rc, rb := admit("c"), admit("b")
		if rc.Status != Redeemed || rb.Status != Redeemed {
			t.Fatalf("c %s, b %s back late; want both redeemed (not parked again)", rc.Status, rb.Status)
		}
		if rc.Delay != 0 || !near(rb.At.Sub(rc.At), iv) {
			t.Errorf("c departs in %v, b %v after it; want now, and one interval later", rc.Delay, rb.At.Sub(rc.At))
		}
		// x's departure is the latest; x comes 20ms late for it: it leaves now.
		time.Sleep(time.Until(rb.At))
		x := run("x")
		time.Sleep(time.Until(x.At) + 20*time.Millisecond)
		late, err := u.DepartLate(ctx, "s", 0, x.Slot)
		if err != nil || time.Until(late.At) > 0 {
			t.Errorf("DepartLate of the latest departure: leaves in %v, %v; want now", time.Until(late.At), err)
		}
		// y's has z's after it: y, late, is booked an interval after z's.
		time.Sleep(iv)
		y := run("y")
		z := run("z")
		time.Sleep(time.Until(y.At) + 20*time.Millisecond)
		late, err = u.DepartLate(ctx, "s", 0, y.Slot)
		if err != nil || !near(late.At.Sub(z.At), iv) {
			t.Errorf("DepartLate with a departure after it: leaves %v after that one, %v; want %v", late.At.Sub(z.At), err, iv)
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
