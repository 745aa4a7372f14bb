package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestBackendsLine runs the subject's line (AdmitRequest.Horizon) on every
// backend, with hour-long intervals so that nothing moves while it runs: a
// turn within the horizon is booked, later callers wait in line (charged
// nothing), a caller back while in line keeps its place, and serving the
// line books its members in order once the horizon reaches them. On a
// cluster, every key of the line is in the subject's slot.
func TestBackendsLine(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			for _, algo := range []throttle.Algorithm{throttle.GCRA, throttle.TokenBucket, throttle.SlidingLog} {
				t.Run(string(algo), func(t *testing.T) {
					ctx := context.Background()
					rule := throttle.Rule{Name: "api", Algorithm: algo, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 1}}
					if algo == throttle.SlidingLog {
						rule.Limit = throttle.Limit{Count: 1, Period: 20 * time.Minute}
					}
					l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)}, rule)
					if err != nil {
						t.Fatal(err)
					}
					admit := func(id string, horizon time.Duration) throttle.Admission {
						t.Helper()
						a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "acct", N: 1, Caller: throttle.Caller{ID: id}, Horizon: horizon, Tolerance: time.Minute})
						if err != nil {
							t.Fatalf("Admit %s: %v", id, err)
						}
						return a
					}
					// a now, b in 20 minutes (within 30), c, d, e in line.
					if a := admit("a", 30*time.Minute); a.Status != throttle.Granted {
						t.Fatalf("a: %+v; want granted", a)
					}
					if a := admit("b", 30*time.Minute); a.Status != throttle.Booked || a.InLine || a.Delay < 19*time.Minute || a.Delay > 21*time.Minute {
						t.Fatalf("b: %+v; want booked in 20m", a)
					}
					c := admit("c", 30*time.Minute)
					if !c.InLine || c.Serve.IsZero() || time.Until(c.Serve) < 20*time.Minute || time.Until(c.Serve) > 30*time.Minute {
						t.Fatalf("c: %+v; want in line, the line served in about 25m", c)
					}
					for _, id := range []string{"d", "e"} {
						if a := admit(id, 30*time.Minute); !a.InLine || !a.Serve.IsZero() {
							t.Fatalf("%s: %+v; want in line, the serving left to c's caller", id, a)
						}
					}
					// Back while in line, the line never served: same place, serve now.
					if a := admit("d", 30*time.Minute); !a.InLine || a.Serve.IsZero() || time.Until(a.Serve) > time.Minute {
						t.Fatalf("d again: %+v; want still in line, served at once", a)
					}
					// Nothing charged by the line: a serving within 30 minutes
					// books nothing; one over two hours books c, d, e in order.
					s, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "acct", Horizon: 30 * time.Minute})
					if err != nil || s.Status != throttle.Booked || len(s.Handed) != 0 {
						t.Fatalf("serving within 30m: %+v, %v; want nothing handed, still waiting", s, err)
					}
					// Back while in line, the line just served: no serving asked.
					if a := admit("e", 30*time.Minute); !a.InLine || !a.Serve.IsZero() {
						t.Fatalf("e again: %+v; want still in line, the serving left to its schedule", a)
					}
					s, err = l.Admit(ctx, throttle.AdmitRequest{Subject: "acct", Horizon: 2 * time.Hour})
					if err != nil || s.Status != throttle.Denied || len(s.Handed) != 3 {
						t.Fatalf("serving within 2h: %+v, %v; want c, d, e handed, the line empty", s, err)
					}
					if !(s.Handed["c"].Before(s.Handed["d"]) && s.Handed["d"].Before(s.Handed["e"])) {
						t.Errorf("handed slots %v; want c, d, e in order", s.Handed)
					}
					if d := time.Until(s.Handed["c"]); d < 39*time.Minute || d > 41*time.Minute {
						t.Errorf("c handed a slot in %v, want 40m (after a's and b's)", d)
					}
					// c's turn is booked under its ID: back early, held.
					if a := admit("c", 30*time.Minute); a.Status != throttle.Held {
						t.Errorf("c back: %+v; want its booking held", a)
					}
				})
			}
		})
	}
}

// TestBackendsShareLimit runs a line with a limit per share
// (AdmitRequest.ShareLimit) on every backend, with intervals of minutes so
// that nothing moves while it runs: the key admits one turn per 10
// minutes, each share one per hour, the horizon is 30 minutes. A's first
// caller is granted; its second, held back by A's own limit past the
// horizon while the key has room, starts the line with A asleep; B,
// arriving then, wakes the line for a serving now, which books B's turn
// after a1's and leaves A asleep; once every share sleeps, a serving
// within A's hour books a2 ahead, at that hour. With nobody in line, a
// caller whose own limit admits it later than the key does is booked
// ahead for that moment. On a cluster, everything lives in the subject's
// slot.
func TestBackendsShareLimit(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			rule := throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 6, Period: time.Hour, Burst: 1}}
			l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)}, rule)
			if err != nil {
				t.Fatal(err)
			}
			perShare := throttle.Limit{Count: 1, Period: time.Hour, Burst: 1}
			admit := func(id, share string, horizon time.Duration) throttle.Admission {
				t.Helper()
				a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "key", N: 1, Caller: throttle.Caller{ID: id, Share: share}, Horizon: horizon, ShareLimit: perShare, Tolerance: time.Minute})
				if err != nil {
					t.Fatalf("Admit %s: %v", id, err)
				}
				return a
			}
			serve := func(horizon time.Duration) throttle.Admission {
				t.Helper()
				s, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "key", Horizon: horizon, ShareLimit: perShare})
				if err != nil {
					t.Fatalf("serving: %v", err)
				}
				return s
			}
			near := func(d, want time.Duration) bool { return d > want-time.Minute && d < want+time.Minute }
			const h = 30 * time.Minute
			if a := admit("a1", "A", h); a.Status != throttle.Granted {
				t.Fatalf("a1: %+v; want granted", a)
			}
			a2 := admit("a2", "A", h)
			if !a2.InLine || a2.Serve.IsZero() || !near(time.Until(a2.Serve), 45*time.Minute) {
				t.Fatalf("a2: %+v; want in line, A asleep until its hour, the line served half a horizon before", a2)
			}
			b1 := admit("b1", "B", h)
			if !b1.InLine || b1.Serve.IsZero() || time.Until(b1.Serve) > time.Minute {
				t.Fatalf("b1: %+v; want in line, the line served now (B is awake)", b1)
			}
			s := serve(h)
			if len(s.Handed) != 1 || !near(time.Until(s.Handed["b1"]), 10*time.Minute) {
				t.Fatalf("serving: handed %v; want b1 alone, in 10m (after a1's turn)", s.Handed)
			}
			if s.Status != throttle.Booked || !near(time.Until(s.Serve), 45*time.Minute) {
				t.Fatalf("serving: %+v; want a2 still in line, the next serving half a horizon before A's hour", s)
			}
			// Every share asleep, A's hour within the horizon: a2 is booked
			// ahead, at that hour (the key's turns before it wait for nobody).
			s = serve(2 * time.Hour)
			if len(s.Handed) != 1 || !near(time.Until(s.Handed["a2"]), time.Hour) || s.Status != throttle.Denied {
				t.Fatalf("serving within 2h: %+v; want a2 handed in 1h, the line empty", s)
			}
			// Each turn is booked under its ID: back early, held.
			if a := admit("b1", "B", h); a.Status != throttle.Held {
				t.Errorf("b1 back: %+v; want its booking held", a)
			}
			// Nobody in line: c1 takes the key's next turn (after a2's, at
			// 70m); c2, whose share admits it only at 130m, is booked ahead
			// for then, within a 3h horizon, without joining a line.
			if a := admit("c1", "C", 3*time.Hour); a.Status != throttle.Booked || a.InLine || !near(a.Delay, 70*time.Minute) {
				t.Fatalf("c1: %+v; want booked in 70m", a)
			}
			if a := admit("c2", "C", 3*time.Hour); a.Status != throttle.Booked || a.InLine || !near(a.Delay, 130*time.Minute) {
				t.Fatalf("c2: %+v; want booked in 130m, when C's own limit admits it", a)
			}
		})
	}
}

// TestBackendsLinePriority runs a line with priorities on every backend,
// with hour-long intervals so that nothing moves while it runs: l0 is
// granted, l1 booked, l2 and l3 wait in line at priority 0; h1 joins at
// priority 1 after them, and a serving hands h1 the first turn, then l2
// and l3. A caller whose age bound has passed (a 1µs MaxAge) is served
// before a younger caller of a higher priority. On a cluster, every key of
// the line is in the subject's slot.
func TestBackendsLinePriority(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 1}}
			l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)}, rule)
			if err != nil {
				t.Fatal(err)
			}
			admit := func(id string, prio int, maxAge time.Duration) throttle.Admission {
				t.Helper()
				a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "acct", N: 1, Caller: throttle.Caller{ID: id, Priority: prio}, Horizon: 30 * time.Minute, MaxAge: maxAge, Tolerance: time.Minute})
				if err != nil {
					t.Fatalf("Admit %s: %v", id, err)
				}
				return a
			}
			serve := func(want ...string) {
				t.Helper()
				s, err := l.ServeLine(ctx, "acct", 2*time.Hour, throttle.Limit{})
				if err != nil || len(s.Handed) != len(want) {
					t.Fatalf("serving: %+v, %v; want %v handed", s, err, want)
				}
				for i := 1; i < len(want); i++ {
					if !s.Handed[want[i-1]].Before(s.Handed[want[i]]) {
						t.Fatalf("handed %v; want in the order %v", s.Handed, want)
					}
				}
			}
			if a := admit("l0", 0, time.Hour); a.Status != throttle.Granted {
				t.Fatalf("l0: %+v; want granted", a)
			}
			if a := admit("l1", 0, time.Hour); a.Status != throttle.Booked || a.InLine {
				t.Fatalf("l1: %+v; want booked", a)
			}
			for _, id := range []string{"l2", "l3"} {
				if a := admit(id, 0, time.Hour); !a.InLine {
					t.Fatalf("%s: %+v; want in line", id, a)
				}
			}
			if a := admit("h1", 1, time.Hour); !a.InLine || time.Until(a.At) < time.Hour {
				t.Fatalf("h1: %+v; want in line, its fallback past its age bound", a)
			}
			serve("h1", "l2", "l3")
			// An aged low (MaxAge 1µs, passed by the serving) before a
			// younger high.
			admit("l4", 0, time.Microsecond)
			admit("h2", 1, time.Hour)
			time.Sleep(time.Millisecond)
			serve("l4", "h2")
		})
	}
}
