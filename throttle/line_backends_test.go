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
						a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "acct", N: 1, ID: id, Horizon: horizon, Tolerance: time.Minute})
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
// that nothing moves while it runs: the key admits one turn per 10 minutes,
// each share one per hour. A's first caller is granted; its second, held
// back by A's own limit while the key has room, starts the line with A
// asleep, and the line is served when A's limit admits it; B, arriving
// then, wakes the line for a serving now, which books B's turn 10 minutes
// ahead and leaves A asleep; with every share asleep, no serving books
// ahead of the sleep. On a cluster, the share limits live in the
// subject's slot.
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
			admit := func(id, share string) throttle.Admission {
				t.Helper()
				a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "key", N: 1, ID: id, Horizon: 30 * time.Minute, Share: share, ShareLimit: perShare, Tolerance: time.Minute})
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
			if a := admit("a1", "A"); a.Status != throttle.Granted {
				t.Fatalf("a1: %+v; want granted", a)
			}
			a2 := admit("a2", "A")
			if !a2.InLine || a2.Serve.IsZero() || !near(time.Until(a2.Serve), time.Hour) {
				t.Fatalf("a2: %+v; want in line, A asleep, the line served when A's limit admits it (in 1h)", a2)
			}
			b1 := admit("b1", "B")
			if !b1.InLine || b1.Serve.IsZero() || time.Until(b1.Serve) > time.Minute {
				t.Fatalf("b1: %+v; want in line, the line served now (B is awake)", b1)
			}
			s := serve(30 * time.Minute)
			if len(s.Handed) != 1 || !near(time.Until(s.Handed["b1"]), 10*time.Minute) {
				t.Fatalf("serving: handed %v; want b1 alone, in 10m (after a1's turn)", s.Handed)
			}
			if s.Status != throttle.Booked || !near(time.Until(s.Serve), time.Hour) {
				t.Fatalf("serving: %+v; want a2 still in line, the next serving when A's limit admits it (1h)", s)
			}
			// With every share asleep, even a serving two hours ahead books
			// nothing: a2's turn cannot be booked ahead of the key's without
			// leaving the key a hole, so it waits for A's hour.
			s = serve(2 * time.Hour)
			if len(s.Handed) != 0 || s.Status != throttle.Booked || !near(time.Until(s.Serve), time.Hour) {
				t.Fatalf("serving within 2h: %+v; want nothing handed, the next serving at A's hour", s)
			}
			// Each turn is booked under its ID: back early, held.
			if a := admit("b1", "B"); a.Status != throttle.Held {
				t.Errorf("b1 back: %+v; want its booking held", a)
			}
		})
	}
}
