package throttle

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestAdmitNotBefore: a turn asked no earlier than a time is granted at
// that time exactly when the bucket is free by then, at the bucket's next
// turn when that is later; the turns after it follow it (the gap before it
// stays unused, but for the burst);
// a Granted turn ahead is booked under the caller's ID by Rebook and
// redeemed on that slot; and the windows, a line or a share limit refuse
// it.
func TestAdmitNotBefore(t *testing.T) {
	for _, algo := range []Algorithm{GCRA, TokenBucket} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				testAdmitNotBefore(t, rdb, algo)
			})
		})
	}
}

func testAdmitNotBefore(t *testing.T, rdb *redis.Client, algo Algorithm) {
	ctx := context.Background()
	l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(10).WithBurst(3)})
	first, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "first"}, Wait: -1})
	if err != nil {
		t.Fatal(err)
	}
	start := first.Slot
	admit := func(id string, nb time.Duration) Admission {
		t.Helper()
		req := AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Wait: -1, EarlyWait: time.Second}
		if nb >= 0 {
			req.NotBefore = start.Add(nb)
		}
		a, err := l.Admit(ctx, req)
		if err != nil {
			t.Fatalf("Admit %s: %v", id, err)
		}
		return a
	}
	a := admit("a", 5*time.Second)
	if a.Status != Granted || a.Slot.Sub(start) != 5*time.Second {
		t.Fatalf("a: %s at %v, want granted at 5s", a.Status, a.Slot.Sub(start))
	}
	// The bucket took a at 5s as if full then (burst 3): the next turns
	// follow a's in the bucket, the first two within its burst around a.
	for i, want := range []time.Duration{4900 * ms, 5 * time.Second, 5100 * ms} {
		if got := admit(string(rune('b'+i)), 0).Slot.Sub(start); got != want {
			t.Errorf("turn %d after it: at %v, want %v", i+2, got, want)
		}
	}
	if got := admit("e", 2*time.Second).Slot.Sub(start); got != 5*time.Second+200*ms {
		t.Errorf("a turn not before 2s, once the bucket is booked past it: at %v, want 5.2s", got)
	}
	if ok, err := a.Reservation.Rebook(ctx); !ok || err != nil {
		t.Fatalf("Rebook of the granted turn at 5s: %v, %v; want true", ok, err)
	}
	time.Sleep(5*time.Second - 50*ms)
	back := admit("a", -1)
	if back.Status != Redeemed || back.Slot.Sub(start) != 5*time.Second || back.Reservation == nil {
		t.Errorf("a back at 4.95s: %s at %v, want its booking at 5s redeemed, with its tickets", back.Status, back.Slot.Sub(start))
	}
	for name, req := range map[string]AdmitRequest{
		"line":  {Subject: "s", N: 1, Caller: Caller{ID: "x"}, Horizon: time.Second, NotBefore: start},
		"share": {Subject: "s", N: 1, Caller: Caller{ID: "x"}, ShareLimit: PerSecond(1), NotBefore: start},
	} {
		if _, err := l.Admit(ctx, req); err == nil {
			t.Errorf("%s: NotBefore accepted", name)
		}
	}
	w := mustNew(t, rdb, Options{}, Rule{Name: "w", Algorithm: FixedWindow, Limit: PerSecond(10)})
	_, err = w.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "x"}, NotBefore: start})
	if err == nil || errors.Is(err, ErrRedis) {
		t.Errorf("a fixed window: %v, want a refusal naming the bucket algorithms", err)
	}
}
