package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestShareCancel: a turn Admit granted under a ShareLimit and cancelled
// before its slot gives its share's turn back with the rules': the next
// caller of that share, its share at its limit, gets the freed turn (at
// once, or at the cancelled slot), on virtual time. A turn made before a
// Reset of the rules gives the share nothing back either, as the rules'
// refunds do (lua/refund.lua).
func TestShareCancel(t *testing.T) {
	cases := []struct {
		name   string
		before int           // turns granted to the share before the one cancelled
		reset  bool          // Reset the subject before cancelling
		want   time.Duration // the next caller's delay
	}{
		{"at-once", 0, false, 0},
		{"at-the-cancelled-slot", 1, false, time.Second},
		{"not-after-a-reset", 0, true, time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, Rule{Name: "key", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(10)})
				admit := func(id string) Admission {
					t.Helper()
					a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id, Share: "A"},
						Wait: 5 * time.Second, Horizon: 5 * time.Second, ShareLimit: PerSecond(1).WithBurst(1)})
					if err != nil {
						t.Fatalf("Admit %s: %v", id, err)
					}
					if a.Status != Granted {
						t.Fatalf("Admit %s: %s, want granted", id, a.Status)
					}
					return a
				}
				for i := range tc.before {
					admit("early" + string(rune('0'+i)))
				}
				cancelled := admit("cancelled")
				if tc.reset {
					if err := l.Reset(ctx, "acct"); err != nil {
						t.Fatalf("Reset: %v", err)
					}
				}
				if err := cancelled.Reservation.Cancel(ctx); err != nil {
					t.Fatalf("Cancel: %v", err)
				}
				next := admit("next")
				if next.Delay != tc.want {
					t.Errorf("the next caller of the share: delay %v, want %v (the cancelled turn's %v)", next.Delay, tc.want, cancelled.Delay)
				}
			})
		})
	}
}

// TestShareCancelBatch: cancels of one subject sent in one refund call
// (refund.go batches them) give back each one's share turn: two granted
// turns of a share at its limit, cancelled latest first in one call, free
// both, and the next caller of the share is granted at once. (The key's
// burst covers the second's slot: a turn booked ahead moves the rules'
// state to its slot, which its refund does not undo.)
func TestShareCancelBatch(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "key", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(200)})
		admit := func(id string) *Reservation {
			t.Helper()
			a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: id, Share: "A"},
				Wait: 5 * time.Second, Horizon: 5 * time.Second, ShareLimit: PerSecond(1).WithBurst(1)})
			if err != nil || a.Status != Granted {
				t.Fatalf("Admit %s: %+v, %v; want granted", id, a, err)
			}
			return a.Reservation
		}
		first, second := admit("first"), admit("second")
		var batch []*refundEntry
		for _, r := range []*Reservation{second, first} {
			batch = append(batch, &refundEntry{ctx: ctx, n: r.n, booked: r.booked, tickets: r.tickets, share: r.share})
		}
		if err := l.refundNow("acct", batch, false); err != nil {
			t.Fatalf("refunding both in one call: %v", err)
		}
		next, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: "next", Share: "A"},
			Wait: 5 * time.Second, Horizon: 5 * time.Second, ShareLimit: PerSecond(1).WithBurst(1)})
		if err != nil || next.Status != Granted || next.Delay != 0 {
			t.Errorf("the next caller of the share: %s after %v (%v), want granted at once", next.Status, next.Delay, err)
		}
	})
}
