package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestRebook: a Redeemed turn booked again before its slot is redeemed
// again, on the same slot and with its tickets (to Settle); nothing is
// booked again for a turn that is not a redeemed one, once its slot has
// passed, or twice.
func TestRebook(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(5).WithBurst(1)})
		start := time.Now()
		admit := func(id string, early time.Duration) Admission {
			t.Helper()
			a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, EarlyWait: early, Tolerance: 50 * ms})
			if err != nil {
				t.Fatalf("Admit %s: %v", id, err)
			}
			return a
		}
		first := admit("first", 0)
		if ok, err := first.Reservation.Rebook(ctx); ok || err != nil {
			t.Errorf("Rebook of a granted turn: %v, %v; want false", ok, err)
		}
		if a := admit("second", 0); a.Status != Booked || a.Slot.Sub(start) != 200*ms {
			t.Fatalf("second: %+v; want booked for 200ms", a)
		}
		a := admit("second", time.Second)
		if a.Status != Redeemed || a.Reservation == nil {
			t.Fatalf("second back early: %+v; want redeemed with a reservation", a)
		}
		if ok, err := a.Reservation.Rebook(ctx); !ok || err != nil {
			t.Fatalf("Rebook before its slot: %v, %v; want true", ok, err)
		}
		if ok, _ := a.Reservation.Rebook(ctx); ok {
			t.Errorf("a second Rebook booked it again")
		}
		again := admit("second", time.Second)
		if again.Status != Redeemed || again.Slot.Sub(start) != 200*ms || again.Reservation == nil {
			t.Fatalf("second back again: %+v; want its turn at 200ms redeemed, with its tickets", again)
		}
		time.Sleep(again.Delay + 100*ms)
		if ok, err := again.Reservation.Rebook(ctx); ok || err != nil {
			t.Errorf("Rebook after its slot: %v, %v; want false", ok, err)
		}
		if a := admit("third", 0); a.Slot.Sub(start) != 400*ms {
			t.Errorf("third: turn at %v, want 400ms: one turn per caller", a.Slot.Sub(start))
		}
	})
}
