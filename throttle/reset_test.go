package throttle

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// resetRule is the rule of the Reset tests: 5 an hour, burst 5, so that
// nothing refills while a test runs.
func resetRule(a Algorithm) Rule {
	return Rule{Name: "r", Algorithm: a, Limit: Limit{Count: 5, Period: time.Hour, Burst: 5}}
}

// A refund path: take reserves 2 permits of subject "s" and returns what
// gives them back.
type refundPath struct {
	name    string
	buckets bool // only the bucket algorithms hold a reservation this way
	take    func(t *testing.T, l *Limiter) (giveBack func() error)
}

var refundPaths = []refundPath{
	{name: "Cancel", take: func(t *testing.T, l *Limiter) func() error {
		r := mustReserve(t, l, 2)
		return func() error { return r.Cancel(context.Background()) }
	}},
	{name: "prepaid Cancel", take: func(t *testing.T, l *Limiter) func() error {
		r, err := l.PrepayN(context.Background(), "s", 2, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return func() error { return r.Cancel(context.Background()) }
	}},
	// The worker's refund: admission's gate cancels the reservation of a
	// turn Admit granted when the task's context ends before it.
	{name: "Admit Cancel", take: func(t *testing.T, l *Limiter) func() error {
		a, err := l.Admit(context.Background(), AdmitRequest{Subject: "s", N: 2, Wait: -1})
		if err != nil || a.Status != Granted || a.Reservation == nil {
			t.Fatalf("Admit = %+v, %v; want granted", a, err)
		}
		return func() error { return a.Reservation.Cancel(context.Background()) }
	}},
	{name: "Settle", take: func(t *testing.T, l *Limiter) func() error {
		r := mustReserve(t, l, 2)
		return func() error { return r.Settle(context.Background(), 0) }
	}},
	// The worker's settle of a turn it redeemed (a prepaid receipt, or a
	// booking): its tickets and booking time come from Redis.
	{name: "redeemed Settle", take: func(t *testing.T, l *Limiter) func() error {
		p, err := l.PrepayN(context.Background(), "s", 2, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		a, err := l.Admit(context.Background(), AdmitRequest{Subject: "s", N: 2, Caller: Caller{Receipt: receiptOf(p)}, Wait: -1, Tolerance: time.Hour})
		if err != nil || a.Status != Redeemed || a.Reservation == nil {
			t.Fatalf("Admit on the receipt = %+v, %v; want redeemed", a, err)
		}
		return func() error { return a.Reservation.Settle(context.Background(), 0) }
	}},
	// A part rolled back when another subject's rules refuse (subjects.go).
	{name: "undo", take: func(t *testing.T, l *Limiter) func() error {
		r := mustReserve(t, l, 2)
		return func() error { return r.cancel(context.Background(), true) }
	}},
	// Wait's refund when its context ends before its slot (windows do not
	// reserve ahead in Wait: their waiters queue in the process).
	{name: "Wait", buckets: true, take: func(t *testing.T, l *Limiter) func() error {
		ctx, cancel := context.WithCancel(context.Background())
		var err error
		var wg sync.WaitGroup
		wg.Go(func() { err = l.WaitN(ctx, "s", 2) })
		synctest.Wait() // asleep until its slot, reserved
		return func() error {
			cancel()
			wg.Wait()
			if err != context.Canceled {
				t.Fatalf("Wait = %v, want context.Canceled", err)
			}
			return nil
		}
	}},
}

// eachRateAlgorithm runs f for every algorithm that counts permits, each
// a subtest in a virtual-time bubble of its own.
func eachRateAlgorithm(t *testing.T, f func(t *testing.T, a Algorithm, rdb *redis.Client)) {
	for _, a := range rateAlgorithms() {
		t.Run(string(a), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) { f(t, a, rdb) })
		})
	}
}

func mustReserve(t *testing.T, l *Limiter, n int) *Reservation {
	t.Helper()
	r, err := l.ReserveN(context.Background(), "s", n)
	if err != nil {
		t.Fatalf("ReserveN(%d): %v", n, err)
	}
	return r
}

// A reservation made before Reset gives nothing back into the state after
// it, whichever way it is given back, under every algorithm (issue 20.2):
// the new state admits exactly its capacity, not that plus the permits
// refunded. A bucket holds its reservation ahead (it gives back only
// before the time to act); a window's is counted now. gap is the Redis
// time between the steps: none (every call in one microsecond) or 1ms.
func TestResetReservationGivesNothingBack(t *testing.T) {
	for _, a := range rateAlgorithms() {
		for _, p := range refundPaths {
			if p.buckets && !a.bucket() {
				continue
			}
			for _, gap := range []time.Duration{0, ms} {
				t.Run(string(a)+"/"+p.name+"/gap "+gap.String(), func(t *testing.T) {
					virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
						l := mustNew(t, rdb, Options{}, resetRule(a))
						if a.bucket() {
							allow(t, l, "s", 5)
						}
						giveBack := p.take(t, l)
						time.Sleep(gap)
						if err := l.Reset(context.Background(), "s"); err != nil {
							t.Fatal(err)
						}
						time.Sleep(gap)
						if got := admitted(t, l, "s", 10); got != 5 {
							t.Fatalf("%d admitted after Reset, want 5", got)
						}
						if err := giveBack(); err != nil {
							t.Fatal(err)
						}
						if got := admitted(t, l, "s", 10); got != 0 {
							t.Fatalf("%s after Reset gave %d back into the new state, want 0", p.name, got)
						}
					})
				})
			}
		}
	}
}

// Refunds still work after a Reset for reservations made after it, and
// for reservations that another limiter's Reset did not touch: the record
// of a Reset is per rule.
func TestResetRefundsLaterReservations(t *testing.T) {
	eachRateAlgorithm(t, func(t *testing.T, a Algorithm, rdb *redis.Client) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, resetRule(a))
		other := resetRule(a)
		other.Name = "other"
		o := mustNew(t, rdb, Options{}, other)
		// A bucket's kept reservation lies ahead (a bucket gives back
		// only before the time to act): 3 taken, 4 reserved, 2 of
		// them in debt.
		want, wantKept := 5, 5
		if a.bucket() {
			allow(t, o, "s", 3)
			want, wantKept = 2, 2
		}
		kept := mustReserve(t, o, 4)
		time.Sleep(ms)
		if err := l.Reset(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(ms)
		if a.bucket() {
			allow(t, l, "s", 3)
		}
		r := mustReserve(t, l, 2)
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if got := admitted(t, l, "s", 10); got != want {
			t.Fatalf("after a reservation made after Reset was cancelled: %d admitted, want %d", got, want)
		}
		if err := kept.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if got := admitted(t, o, "s", 10); got != wantKept {
			t.Fatalf("rule %q, not reset: %d admitted after its reservation was cancelled, want %d", other.Name, got, wantKept)
		}
	})
}

// A Settle for more than was reserved, after Reset, charges the
// difference to the new state: the work used it (Settle's doc).
func TestResetSettleUpCharges(t *testing.T) {
	eachRateAlgorithm(t, func(t *testing.T, a Algorithm, rdb *redis.Client) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, resetRule(a))
		r := mustReserve(t, l, 2)
		time.Sleep(ms)
		if err := l.Reset(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if got := admitted(t, l, "s", 2); got != 2 {
			t.Fatalf("%d admitted after Reset, want 2", got)
		}
		if err := r.Settle(ctx, 4); err != nil {
			t.Fatal(err)
		}
		if got := admitted(t, l, "s", 10); got != 1 {
			t.Fatalf("%d admitted after a settle 2 up, want 1 (5 - 2 - 2)", got)
		}
	})
}

// A process's leased slots that it gives back (idle, or a lease whose
// clock was too uncertain) give nothing into a state that another process
// reset after the lease was granted.
func TestResetLeaseGivesNothingBack(t *testing.T) {
	for _, a := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(a), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				ctx := context.Background()
				rule := Rule{Name: "hot", Algorithm: a, Limit: PerSecond(1000).WithBurst(10)}
				p := newProc(t, m, rule)
				plain := mustNew(t, rdb, Options{}, rule)
				allow(t, plain, "hot", 10) // the lease's slots lie ahead
				q := leaserOf(p.lim)
				ls := takeLease(t, q, "hot", 8)
				time.Sleep(time.Microsecond)
				if err := plain.Reset(ctx, "hot"); err != nil {
					t.Fatal(err)
				}
				if got := admitted(t, plain, "hot", 20); got != 10 {
					t.Fatalf("%d admitted after Reset, want 10", got)
				}
				if !q.giveBackLease(ctx, "hot", ls.k, ls.ticket, ls.booked) {
					t.Fatal("the give-back failed")
				}
				if got := admitted(t, plain, "hot", 20); got != 0 {
					t.Fatalf("the lease given back after Reset gave %d into the new state, want 0", got)
				}
			})
		})
	}
}

// One refund call gives back several reservations (refund.go batches
// them), each with its own booking time: of a reservation made before
// Reset and one made after, in either order, only the later comes back.
func TestResetRefundBatch(t *testing.T) {
	for _, first := range []string{"earlier first", "later first"} {
		t.Run(first, func(t *testing.T) {
			eachRateAlgorithm(t, func(t *testing.T, a Algorithm, rdb *redis.Client) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, resetRule(a))
				if a.bucket() {
					allow(t, l, "s", 5)
				}
				before := mustReserve(t, l, 2)
				time.Sleep(ms)
				if err := l.Reset(ctx, "s"); err != nil {
					t.Fatal(err)
				}
				time.Sleep(ms)
				after := mustReserve(t, l, 2)
				if got := admitted(t, l, "s", 10); got != 3 {
					t.Fatalf("%d admitted after Reset and a reservation of 2, want 3", got)
				}
				batch := []*refundEntry{
					{ctx: ctx, n: 2, booked: before.booked, tickets: before.tickets},
					{ctx: ctx, n: 2, booked: after.booked, tickets: after.tickets},
				}
				if first == "later first" {
					batch[0], batch[1] = batch[1], batch[0]
				}
				if err := l.refundNow("s", batch, false); err != nil {
					t.Fatal(err)
				}
				if got := admitted(t, l, "s", 10); got != 2 {
					t.Fatalf("%d admitted after the batch, want the 2 of the later reservation", got)
				}
			})
		})
	}
}
