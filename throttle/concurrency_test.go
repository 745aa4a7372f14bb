package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// concRule is at most two holders at once, each leased for 30s.
var concRule = Rule{Name: "conc", Algorithm: Concurrency, Limit: Limit{Count: 2, Period: 30 * time.Second}}

// handoffs records what a limiter's OnHandoff receives.
type handoffs struct {
	mu  sync.Mutex
	ids []string
}

func (h *handoffs) add(ids []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ids = append(h.ids, ids...)
}

func (h *handoffs) len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ids)
}

func (h *handoffs) take() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	ids := h.ids
	h.ids = nil
	return ids
}

// admitID admits the caller id and fails the test on error.
func admitID(t *testing.T, l *Limiter, id string) Admission {
	t.Helper()
	a, err := l.Admit(context.Background(), AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: id}, Wait: 0, Tolerance: time.Second})
	if err != nil {
		t.Fatalf("Admit(%s): %v", id, err)
	}
	return a
}

// TestConcurrencyQueue takes both places, queues two more callers in
// arrival order with a fallback at the earliest lease's expiry, and hands
// each freed place to the head of the queue: the releaser's OnHandoff names
// it, and it is granted when it comes back, before any newcomer.
func TestConcurrencyQueue(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		h := &handoffs{}
		l := mustNew(t, rdb, Options{OnHandoff: h.add}, concRule)
		ctx := context.Background()
		for _, id := range []string{"a", "b"} {
			if a := admitID(t, l, id); a.Status != Granted {
				t.Fatalf("%s: got %v, want granted", id, a.Status)
			}
		}
		for _, id := range []string{"c", "d", "c"} {
			a := admitID(t, l, id)
			if a.Status != Booked || a.Rule != "conc" {
				t.Fatalf("%s: got %v by %q, want booked (queued) by conc", id, a.Status, a.Rule)
			}
			if a.Delay != 30*time.Second {
				t.Fatalf("%s: fallback in %v, want 30s (the earliest lease's expiry)", id, a.Delay)
			}
		}
		time.Sleep(time.Second)
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if got := h.take(); !slices.Equal(got, []string{"c"}) {
			t.Fatalf("handed off to %v, want [c] (the head of the queue)", got)
		}
		if a := admitID(t, l, "e"); a.Status != Booked {
			t.Fatalf("newcomer e: got %v, want queued behind d", a.Status)
		}
		if a := admitID(t, l, "c"); a.Status != Granted {
			t.Fatalf("c, back: got %v, want granted on the place handed to it", a.Status)
		}
		for range 2 {
			if err := l.Release(ctx, "s"); err != nil {
				t.Fatal(err)
			}
		}
		if got := h.take(); !slices.Equal(got, []string{"d", "e"}) {
			t.Fatalf("handed off to %v, want [d e]", got)
		}
		for _, id := range []string{"d", "e"} {
			if a := admitID(t, l, id); a.Status != Granted {
				t.Fatalf("%s: got %v, want granted", id, a.Status)
			}
		}
		for range 2 {
			if err := l.Release(ctx, "s"); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.Release(ctx, "s"); err == nil {
			t.Fatal("Release with no place held: got nil error")
		}
	})
}

// TestConcurrencyDeadHolder: a process that dies holding a place (its
// renewals stop) loses it when its lease expires, and the live holder's
// renewal hands it to the waiter; while a holder lives, renewals keep its
// place however long it runs.
func TestConcurrencyDeadHolder(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		rule := concRule
		rule.Limit.Period = 3 * time.Second
		h := &handoffs{}
		live := mustNew(t, rdb, Options{OnHandoff: h.add}, rule)
		rdb2 := redistest.PipeClient(m)
		defer rdb2.Close()
		dead := mustNew(t, rdb2, Options{}, rule)
		if a := admitID(t, live, "live"); a.Status != Granted {
			t.Fatalf("live: %v", a.Status)
		}
		if a := admitID(t, dead, "dead"); a.Status != Granted {
			t.Fatalf("dead: %v", a.Status)
		}
		// The dead process stops renewing: it forgets its place.
		placesOf(dead).drop("s", "dead")
		start := time.Now()
		if a := admitID(t, live, "waiter"); a.Status != Booked {
			t.Fatalf("waiter: %v", a.Status)
		}
		for h.len() == 0 && time.Since(start) < 10*time.Second {
			time.Sleep(100 * time.Millisecond)
		}
		got, took := h.take(), time.Since(start)
		if !slices.Equal(got, []string{"waiter"}) {
			t.Fatalf("handed off to %v, want [waiter]", got)
		}
		if took < 3*time.Second || took > 3*time.Second+rule.Limit.Period/3+200*time.Millisecond {
			t.Fatalf("the dead holder's place was handed on after %v, want within a third of a lease after its 3s lease", took)
		}
		// The live holder still holds its place (10 leases later).
		time.Sleep(30 * time.Second)
		if a := admitID(t, live, "waiter"); a.Status != Granted {
			t.Fatalf("waiter back: %v, want granted", a.Status)
		}
		if a := admitID(t, live, "late"); a.Status != Booked {
			t.Fatalf("late: %v, want queued: the live holder and the waiter hold both places", a.Status)
		}
		for range 2 {
			if err := live.Release(context.Background(), "s"); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestConcurrencyPolicy: 1/s (burst 1) and at most one at once, decided
// together. A caller that finds the place taken is queued without taking a
// turn of the rate rule; one whose booked turn comes due while the place is
// taken keeps that turn, paid, and runs on it when it has the place:
// neither lost nor charged twice.
func TestConcurrencyPolicy(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rate := Rule{Name: "rate", Algorithm: GCRA, Limit: PerSecond(1)}
		one := Rule{Name: "one", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: 30 * time.Second}}
		h := &handoffs{}
		l := mustNew(t, rdb, Options{OnHandoff: h.add}, rate, one)
		state := mustNew(t, rdb, Options{}, rate) // reads the rate rule's key
		tokens := func() int { return allow(t, state, "s", 0).Remaining }

		if a := admitID(t, l, "a"); a.Status != Granted {
			t.Fatalf("a: %v", a.Status)
		}
		if a := admitID(t, l, "b"); a.Status != Booked || a.Rule != "one" {
			t.Fatalf("b: %v by %q, want queued by one", a.Status, a.Rule)
		}
		time.Sleep(time.Second) // the bucket refills: a queued caller took no turn
		if got := tokens(); got != 1 {
			t.Fatalf("tokens after b queued: %d, want 1", got)
		}
		// a ends: b is handed the place, and takes the token.
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if a := admitID(t, l, "b"); a.Status != Granted {
			t.Fatalf("b with the place: %v, want granted", a.Status)
		}
		if a := admitID(t, l, "c"); a.Status != Booked || a.Rule != "one" {
			t.Fatalf("c: %v by %q, want queued by one", a.Status, a.Rule)
		}
		if err := l.Release(ctx, "s"); err != nil { // b ends: c is handed the place
			t.Fatal(err)
		}
		if got := h.take(); !slices.Equal(got, []string{"b", "c"}) {
			t.Fatalf("handoffs %v, want [b c]", got)
		}
		// c has the place, but its rate turn is 1s away: it books the turn
		// and gives the place up.
		a := admitID(t, l, "c")
		if a.Status != Booked || a.Rule != "rate" || a.Delay != time.Second {
			t.Fatalf("c with the place: %v by %q in %v, want booked by rate in 1s", a.Status, a.Rule, a.Delay)
		}
		// Another process holds the place when c's turn comes: c keeps its
		// turn, paid, and waits for the place.
		other := mustNew(t, rdb, Options{}, one)
		if a := admitID(t, other, "e"); a.Status != Granted {
			t.Fatalf("e: %v, want granted: the place was free", a.Status)
		}
		time.Sleep(a.Delay)
		if a := admitID(t, l, "c"); a.Status != Booked || a.Rule != "one" {
			t.Fatalf("c at its turn, place taken: %v by %q, want queued by one", a.Status, a.Rule)
		}
		time.Sleep(5 * time.Second) // far past c's turn and its tolerance
		// A prepay clears stale receipts from the set that keeps c's paid turn.
		if _, err := l.PrepayN(ctx, "s", 1, time.Millisecond); err != nil {
			t.Fatal(err)
		}
		before := tokens()
		if err := other.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if a := admitID(t, l, "c"); a.Status != Redeemed {
			t.Fatalf("c with the place: %v, want redeemed on its paid turn", a.Status)
		}
		if got := tokens(); got != before {
			t.Fatalf("tokens: %d after c ran, %d before: its turn was charged again", got, before)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
	})
}

// TestConcurrencyWaitRelease: Wait takes a place or waits in line for one;
// Release in this process wakes the next waiter at once; a Wait whose
// context ends leaves the line.
func TestConcurrencyWaitRelease(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		one := Rule{Name: "one", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: 30 * time.Second}}
		l := mustNew(t, rdb, Options{}, one)
		if err := l.Wait(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		short, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		if err := l.Wait(short, "s"); err != context.DeadlineExceeded {
			t.Fatalf("Wait with a 1s context: %v, want context.DeadlineExceeded", err)
		}
		got := make(chan time.Duration)
		start := time.Now()
		go func() {
			if err := l.Wait(ctx, "s"); err != nil {
				t.Error(err)
			}
			got <- time.Since(start)
		}()
		time.Sleep(2 * time.Second)
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if d := <-got; d != 2*time.Second {
			t.Fatalf("the waiter took the place after %v, want 2s (at the release)", d)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Allow(ctx, "s"); err == nil {
			t.Fatal("Allow on a concurrency limit: got nil error")
		}
	})
}

// TestConcurrencyPause: PauseFor on a policy with a concurrency rule holds
// back its rate rule and leaves the places alone.
func TestConcurrencyPause(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "rate", Algorithm: GCRA, Limit: PerSecond(10)}, concRule)
		if _, err := l.PauseFor(ctx, "s", 5*time.Second); err != nil {
			t.Fatal(err)
		}
		a := admitID(t, l, "a")
		if a.Status != Booked || a.Rule != "rate" || a.Delay != 5*time.Second {
			t.Fatalf("after a 5s pause: %v by %q in %v, want booked by rate in 5s", a.Status, a.Rule, a.Delay)
		}
		if _, _, err := l.AllowAtMost(ctx, "s", 1); err == nil {
			t.Fatal("AllowAtMost on a concurrency limit: got nil error")
		}
	})
}

// TestConcurrencyWaitAs: a caller that comes back under another id (a task
// requeued as a copy) keeps its place in the queue under that id.
func TestConcurrencyWaitAs(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		h := &handoffs{}
		one := Rule{Name: "one", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: 30 * time.Second}}
		l := mustNew(t, rdb, Options{OnHandoff: h.add}, one)
		for _, id := range []string{"a", "x", "b"} {
			admitID(t, l, id)
			time.Sleep(time.Millisecond) // arrivals at one µs are ordered by id
		}
		a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "x", WaitAs: "x~1"}, Tolerance: time.Second})
		if err != nil || a.Status != Booked {
			t.Fatalf("x as x~1: %v, %v; want queued", a.Status, err)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
		if got := h.take(); !slices.Equal(got, []string{"x~1"}) {
			t.Fatalf("handed off to %v, want [x~1]: x's place, ahead of b", got)
		}
		if a := admitID(t, l, "x~1"); a.Status != Granted {
			t.Fatalf("x~1: %v, want granted", a.Status)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
	})
}

// TestConcurrencySweep: Admit with N = 0 takes nothing; it hands the places
// of expired leases to their waiters (OnHandoff), and says when to look
// again while some wait: how a fleet whose holders all died goes on.
func TestConcurrencySweep(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		h := &handoffs{}
		one := Rule{Name: "one", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: 3 * time.Second}}
		l := mustNew(t, rdb, Options{OnHandoff: h.add}, one)
		sweep := func() Admission {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "s", N: 0, Caller: Caller{Waiter: "sweep"}, Tolerance: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		if a := sweep(); a.Status != Denied {
			t.Fatalf("sweep of an idle subject: %v, want denied (nobody waits)", a.Status)
		}
		admitID(t, l, "dead")
		placesOf(l).drop("s", "dead") // its process dies
		admitID(t, l, "w")
		a := sweep()
		if a.Status != Booked || a.Delay != 3*time.Second {
			t.Fatalf("sweep while w waits: %v in %v, want booked in 3s (the dead lease's expiry)", a.Status, a.Delay)
		}
		time.Sleep(a.Delay)
		if a := sweep(); a.Status != Denied {
			t.Fatalf("sweep after the expiry: %v, want denied (w was handed the place)", a.Status)
		}
		if got := h.take(); !slices.Equal(got, []string{"w"}) {
			t.Fatalf("handed off to %v, want [w]", got)
		}
		if a := admitID(t, l, "w"); a.Status != Granted {
			t.Fatalf("w: %v, want granted", a.Status)
		}
		if err := l.Release(ctx, "s"); err != nil {
			t.Fatal(err)
		}
	})
}

// TestConcurrencyReleaseRace: concurrent Releases in one process give back
// every place the process holds, one each (they once picked the same one).
func TestConcurrencyReleaseRace(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		many := Rule{Name: "many", Algorithm: Concurrency, Limit: Limit{Count: 50, Period: 30 * time.Second}}
		l := mustNew(t, rdb, Options{}, many)
		for i := range 50 {
			admitID(t, l, fmt.Sprint("h", i))
		}
		var wg sync.WaitGroup
		errs := make(chan error, 50)
		for range 50 {
			wg.Go(func() { errs <- l.Release(ctx, "s") })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if n := rdb.ZCard(ctx, "jobthrottle:{s}:many").Val(); n != 0 {
			t.Fatalf("%d places still held, want 0", n)
		}
	})
}

// A Place gives back the place of its own holder, not the latest this
// process took; a second Release of it fails and gives back nothing; the
// ctx of Release is honoured.
func TestPlaceRelease(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		h := &handoffs{}
		l := mustNew(t, rdb, Options{OnHandoff: h.add}, concRule)
		defer l.Close()
		ctx := context.Background()
		a, b := admitID(t, l, "a"), admitID(t, l, "b")
		if a.Place == nil || b.Place == nil {
			t.Fatalf("places %v, %v: want both held", a.Place, b.Place)
		}
		if c := admitID(t, l, "c"); c.Status != Booked || c.Place != nil {
			t.Fatalf("c: %v, place %v; want queued, no place", c.Status, c.Place)
		}
		if err := a.Place.Release(ctx); err != nil {
			t.Fatalf("a's Release: %v", err)
		}
		key := "jobthrottle:{s}:conc"
		if got, _ := m.ZMembers(key); !slices.Equal(got, []string{"b", "c"}) {
			t.Errorf("holders %q, want [b c]: a gave its own place to c", got)
		}
		if got := h.take(); !slices.Equal(got, []string{"c"}) {
			t.Fatalf("handed off to %v, want [c]", got)
		}
		if err := a.Place.Release(ctx); err == nil {
			t.Error("a second Release of a's place: nil error")
		}
		if got, _ := m.ZMembers(key); !slices.Equal(got, []string{"b", "c"}) {
			t.Errorf("holders %q after a second Release of a's place, want [b c]", got)
		}
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		if err := b.Place.Release(cancelled); !errors.Is(err, context.Canceled) || !errors.Is(err, ErrRedis) {
			t.Errorf("Release with an ended ctx: %v, want ErrRedis and context.Canceled", err)
		}
		if err := (*Place)(nil).Release(ctx); err != nil {
			t.Errorf("a nil Place's Release: %v", err)
		}
	})
}

// Acquire hands back the place it took, and a nil Place without a
// Concurrency rule.
func TestAcquire(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, concRule)
		defer l.Close()
		p, err := l.Acquire(ctx, "s", 1)
		if err != nil || p == nil {
			t.Fatalf("Acquire: %v, %v; want a place", p, err)
		}
		if n, _ := rdb.ZCard(ctx, "jobthrottle:{s}:conc").Result(); n != 1 {
			t.Fatalf("%d places held, want 1", n)
		}
		if err := p.Release(ctx); err != nil {
			t.Fatalf("Release: %v", err)
		}
		if n, _ := rdb.ZCard(ctx, "jobthrottle:{s}:conc").Result(); n != 0 {
			t.Fatalf("%d places held after Release, want 0", n)
		}
		rate := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(10)})
		if p, err := rate.Acquire(ctx, "s", 1); err != nil || p != nil {
			t.Fatalf("Acquire without a Concurrency rule: %v, %v; want no place", p, err)
		}
	})
}
