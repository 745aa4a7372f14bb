package admission

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const ms = time.Millisecond

func newGate(t *testing.T, rdb redis.UniversalClient, opts Options, rule throttle.Rule) *Gate {
	t.Helper()
	lim, err := throttle.New(rdb, throttle.Options{}, rule)
	if err != nil {
		t.Fatal(err)
	}
	g, err := New(lim, opts)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

var gcra5 = throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)}

// comeBack brings parked job id of subject "acct" back at its turn, at,
// and reports whether it ran at once on its booking (else the test fails).
func comeBack(ctx context.Context, t *testing.T, g *Gate, id string, at time.Time) bool {
	time.Sleep(time.Until(at))
	d, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
	if err != nil || d.Outcome != Run || d.Status != throttle.Redeemed || d.Waited != 0 {
		t.Errorf("%s back at its turn: %+v, %v; want run on its booking at once", id, d, err)
		return false
	}
	return true
}

// recordStart records job id's start, now, as its time since start in
// starts (under mu), failing the test unless it is a multiple of 200ms
// that no other job started at: a 5/s limit's distinct turns.
func recordStart(t *testing.T, mu *sync.Mutex, starts map[time.Duration]string, start time.Time, id string) {
	mu.Lock()
	defer mu.Unlock()
	at := time.Since(start)
	if other, dup := starts[at]; dup || at%(200*ms) != 0 {
		t.Errorf("%s started at %v (also %q): want distinct multiples of 200ms", id, at, other)
	}
	starts[at] = id
}

// TestGateParksABacklog admits 50 jobs of one subject at one instant under
// 5/s with no horizon: the first runs, a few whose turns fall within
// MaxWait wait for them, and the rest park with their turns booked 200ms
// apart; each parked job that comes back at its turn runs at once on its
// booking. (TestGateLine is the same backlog with the default horizon.)
func TestGateParksABacklog(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		g := newGate(t, rdb, Options{EarlyWait: 100 * ms, Settings: Settings{MaxWait: time.Second, WaitSlots: 2, Horizon: -1}}, gcra5)
		ctx := context.Background()
		start := time.Now()
		var mu sync.Mutex
		ran, starts := 0, map[time.Duration]string{}
		var wg sync.WaitGroup
		for i := range 50 {
			id := fmt.Sprintf("job-%02d", i)
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
				if err != nil {
					t.Errorf("Admit %s: %v", id, err)
					return
				}
				if d.Outcome == Run {
					if d.Waited > time.Second {
						t.Errorf("%s waited %v, past MaxWait", id, d.Waited)
					}
					mu.Lock()
					ran++
					mu.Unlock()
				} else {
					// Parked: come back at the turn, and run on the booking.
					if d.Status != throttle.Booked {
						t.Errorf("%s parked with turn %v, want booked", id, d.Status)
					}
					if !comeBack(ctx, t, g, id, d.At) {
						return
					}
				}
				recordStart(t, &mu, starts, start, id)
			}()
		}
		wg.Wait()
		// Only the first job and those whose turns came within MaxWait
		// (200ms to 1s) ran without parking.
		if ran < 1 || ran > 6 {
			t.Errorf("%d jobs ran without parking, want 1 to 6", ran)
		}
		if len(starts) != 50 || time.Since(start) != 49*200*ms {
			t.Errorf("%d distinct starts, the last at %v; want 50, the last at 9.8s", len(starts), time.Since(start))
		}
	})
}

// TestGateLine admits the same backlog with the default horizon (1s): the
// jobs whose turns are more than a second away park in the line, booked
// nothing, and one of them is told to serve it; each serving (Gate.Serve,
// when the last one said) books the next turns no more than a second
// ahead and hands them to their jobs, which come back at their slots and
// run at once. Every job runs once, 200ms apart, the last at 9.8s, as
// without the line.
func TestGateLine(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		g := newGate(t, rdb, Options{EarlyWait: 100 * ms, Settings: Settings{MaxWait: time.Second, WaitSlots: 2}}, gcra5)
		ctx := context.Background()
		start := time.Now()
		var mu sync.Mutex
		woken := map[string]chan time.Time{} // job -> its slot, when handed
		serveAt := make(chan time.Time, 64)
		starts, inLine := map[time.Duration]string{}, 0
		var wg sync.WaitGroup
		for i := range 50 {
			id := fmt.Sprintf("job-%02d", i)
			mu.Lock()
			woken[id] = make(chan time.Time, 1)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
				if err != nil {
					t.Errorf("Admit %s: %v", id, err)
					return
				}
				if d.Outcome == Park {
					if d.InLine {
						mu.Lock()
						inLine++
						mu.Unlock()
						if !d.Serve.IsZero() {
							serveAt <- d.Serve
						}
						slot := <-woken[id]
						if ahead := time.Until(slot); ahead > time.Second {
							t.Errorf("%s handed a turn %v ahead, past the horizon", id, ahead)
						}
						d.At = slot
					}
					if !comeBack(ctx, t, g, id, d.At) {
						return
					}
				}
				recordStart(t, &mu, starts, start, id)
			}()
		}
		// The line's server: serves when told, until the line is empty.
		serves := serveLineUntilEmpty(t, ctx, g, "acct", serveAt, &mu, woken)
		wg.Wait()
		if inLine < 40 {
			t.Errorf("%d of 50 jobs waited in the line, want the 44 or so past a second", inLine)
		}
		if len(starts) != 50 || time.Since(start) != 49*200*ms {
			t.Errorf("%d distinct starts, the last at %v; want 50, the last at 9.8s", len(starts), time.Since(start))
		}
		if n := serves.Load(); n > 25 {
			t.Errorf("%d servings for 44 jobs at 5/s, want about one per half second", n)
		}
	})
}

// TestGateWaitSlots shows a hot subject's waiting jobs cannot take more than
// WaitSlots: with two jobs waiting on it, a third whose turn is inside
// MaxWait parks, while a job of another subject runs at once.
func TestGateWaitSlots(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		g := newGate(t, rdb, Options{EarlyWait: 50 * ms, Settings: Settings{MaxWait: 10 * time.Second, WaitSlots: 2}}, gcra5)
		ctx := context.Background()
		if d, err := g.Admit(ctx, Request{Subject: "hot", Caller: throttle.Caller{ID: "first"}}); err != nil || d.Outcome != Run {
			t.Fatalf("first: %+v %v", d, err)
		}
		var wg sync.WaitGroup
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := g.Admit(ctx, Request{Subject: "hot", Caller: throttle.Caller{ID: fmt.Sprint("waiter", i)}})
				if err != nil || d.Outcome != Run || d.Waited < 200*ms {
					t.Errorf("waiter %d: %+v %v; want run after waiting", i, d, err)
				}
			}()
		}
		time.Sleep(ms) // both waiters are asleep on their turns
		synctest.Wait()
		d, err := g.Admit(ctx, Request{Subject: "hot", Caller: throttle.Caller{ID: "third"}})
		if err != nil || d.Outcome != Park || d.Status != throttle.Booked {
			t.Errorf("third with both slots taken: %+v %v; want parked", d, err)
		}
		if d.Waited != 0 {
			t.Errorf("the parked job waited %v", d.Waited)
		}
		cold, err := g.Admit(ctx, Request{Subject: "cold", Caller: throttle.Caller{ID: "c"}})
		if err != nil || cold.Outcome != Run || cold.Waited != 0 {
			t.Errorf("cold subject: %+v %v; want run at once", cold, err)
		}
		wg.Wait()
	})
}

// TestGateCancelRefunds ends a waiting job's context: Admit returns
// ctx.Err() and the turn is refunded, so the next job gets it.
func TestGateCancelRefunds(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		g := newGate(t, rdb, Options{}, gcra5)
		if _, err := g.Admit(context.Background(), Request{Subject: "s", Caller: throttle.Caller{ID: "a"}}); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*ms)
		defer cancel()
		// The turn is 200ms away, past the context's deadline: with an ID
		// the job parks rather than wait in vain.
		d, err := g.Admit(ctx, Request{Subject: "s", Caller: throttle.Caller{ID: "b"}})
		if err != nil || d.Outcome != Park {
			t.Fatalf("turn past the deadline: %+v, %v; want parked", d, err)
		}
		// Without an ID it cannot park: a DelayError matching the deadline.
		_, err = g.Admit(ctx, Request{Subject: "s"})
		var de *throttle.DelayError
		if !errors.As(err, &de) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("no ID, turn past the deadline: %v; want a *DelayError matching DeadlineExceeded", err)
		}
		// A wait cut short by cancel refunds its turn.
		cctx, ccancel := context.WithCancel(context.Background())
		go func() { time.Sleep(50 * ms); ccancel() }()
		if _, err := g.Admit(cctx, Request{Subject: "s", Caller: throttle.Caller{ID: "c"}}); !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled wait: %v, want context.Canceled", err)
		}
		a, err := g.Limiter().Admit(context.Background(), throttle.AdmitRequest{Subject: "s", N: 1, Caller: throttle.Caller{ID: "d"}, Wait: -1, Tolerance: ms})
		if err != nil || a.Delay != 350*ms {
			t.Errorf("after the refund, the next turn is in %v (%v); want 350ms (400ms - 50ms): b's booked turn, then c's refunded one", a.Delay, err)
		}
	})
}

func TestOptionsErrors(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim, _ := throttle.New(rdb, throttle.Options{}, gcra5)
		for _, cfg := range []Options{{Settings: Settings{MaxWait: -1}}, {Settings: Settings{WaitSlots: -1}}, {EarlyWait: -1}, {Tolerance: -1}} {
			if _, err := New(lim, cfg); err == nil {
				t.Errorf("New(%+v): no error", cfg)
			}
		}
		if _, err := New(nil, Options{}); err == nil {
			t.Error("New(nil): no error")
		}
		// A share limit is kept in the line, which a negative horizon
		// turns off.
		if _, err := New(lim, Options{Settings: Settings{Horizon: -1, ShareLimit: throttle.PerSecond(10)}}); err == nil || !strings.Contains(err.Error(), "share limit needs the subject's line") {
			t.Errorf("New with a share limit and horizon -1: %v; want the share limit refused", err)
		}
		if _, err := New(lim, Options{Settings: Settings{Horizon: -1}}); err != nil {
			t.Errorf("New with horizon -1 and no share limit: %v", err)
		}
	})
}

// TestGateShareLimit: under 100/s for the key and 1/s for each share, with
// a 500ms horizon, share a's second job waits in the line although the key
// has room (its share's limit admits it in a second, past the horizon),
// and the serving hands share b's job its turn at once, a's only when a's
// own limit admits it a second after the first; a's job then runs on it.
// So Admit and Serve both pass the share limit on, also for BookAhead.
func TestGateShareLimit(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		key := throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)}
		g := newGate(t, rdb, Options{Settings: Settings{MaxWait: time.Second, Horizon: 500 * time.Millisecond, ShareLimit: throttle.Limit{Count: 1, Period: time.Second}}}, key)
		ctx := context.Background()
		start := time.Now()
		admit := func(id, share string) Decision {
			t.Helper()
			d, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id, Share: share}})
			if err != nil {
				t.Fatalf("Admit %s: %v", id, err)
			}
			return d
		}
		if d := admit("a1", "a"); d.Outcome != Run || d.Waited != 0 {
			t.Fatalf("a1: %+v; want run at once", d)
		}
		a2 := admit("a2", "a")
		if a2.Outcome != Park || !a2.InLine || a2.Serve.IsZero() {
			t.Fatalf("a2: %+v; want parked in line, told to serve it", a2)
		}
		if d := admit("b1", "b"); d.Outcome != Park || !d.InLine {
			t.Fatalf("b1: %+v; want parked in line behind a2", d)
		}
		s, err := g.Serve(ctx, "acct")
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := s.Handed["b1"]; !ok || len(s.Handed) != 1 || s.Next.IsZero() {
			t.Fatalf("first serving: handed %v, next %v; want b1 alone, a2 still in line", s.Handed, s.Next)
		}
		time.Sleep(time.Until(s.Next))
		s, err = g.Serve(ctx, "acct")
		if err != nil {
			t.Fatal(err)
		}
		slot, ok := s.Handed["a2"]
		if !ok || len(s.Handed) != 1 || !s.Next.IsZero() {
			t.Fatalf("second serving at %v: handed %v, next %v; want a2 alone and the line empty", time.Since(start), s.Handed, s.Next)
		}
		if at := slot.Sub(start); at < time.Second {
			t.Errorf("a2 handed a turn %v after a1; want a second, its share's limit", at)
		}
		time.Sleep(time.Until(slot))
		if d := admit("a2", "a"); d.Outcome != Run || d.Status != throttle.Redeemed {
			t.Errorf("a2 back at its turn: %+v; want run on its booking", d)
		}

		// A job of stacked rules (BookAhead) still goes through the
		// line, where the share limit is kept.
		if d, err := g.Admit(ctx, Request{Subject: "other", BookAhead: true, Caller: throttle.Caller{ID: "c1", Share: "c"}}); err != nil || d.Outcome != Run {
			t.Fatalf("c1 (book ahead): %+v, %v; want run", d, err)
		}
		if d, err := g.Admit(ctx, Request{Subject: "other", BookAhead: true, Caller: throttle.Caller{ID: "c2", Share: "c"}}); err != nil || d.Outcome != Park || !d.InLine {
			t.Errorf("c2 (book ahead): %+v, %v; want parked in line by its share's limit", d, err)
		}
	})
}

// TestGateSharedSlots: two gates (two rules) share a bound of 2 waiting
// jobs: with two jobs of two subjects waiting, a third job of a third
// subject, whose own per-subject slots are free, parks at once.
func TestGateSharedSlots(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		shared := NewSlots(2)
		cfg := Options{EarlyWait: 50 * ms, Shared: shared, Settings: Settings{MaxWait: 10 * time.Second, WaitSlots: 2}}
		a := newGate(t, rdb, cfg, gcra5)
		b := newGate(t, rdb, cfg, throttle.Rule{Name: "other", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)})
		ctx := context.Background()
		for _, g := range []*Gate{a, b} {
			for _, s := range []string{"x", "y", "z"} {
				if d, err := g.Admit(ctx, Request{Subject: s, Caller: throttle.Caller{ID: "first-" + s}}); err != nil || d.Outcome != Run {
					t.Fatalf("first of %s: %+v %v", s, d, err)
				}
			}
		}
		var wg sync.WaitGroup
		for _, w := range []struct {
			g *Gate
			s string
		}{{a, "x"}, {b, "y"}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if d, err := w.g.Admit(ctx, Request{Subject: w.s, Caller: throttle.Caller{ID: "wait-" + w.s}}); err != nil || d.Outcome != Run || d.Waited != 200*ms {
					t.Errorf("waiter on %s: %+v %v; want run after 200ms", w.s, d, err)
				}
			}()
		}
		time.Sleep(ms)
		synctest.Wait()
		d, err := a.Admit(ctx, Request{Subject: "z", Caller: throttle.Caller{ID: "third"}})
		if err != nil || d.Outcome != Park {
			t.Errorf("a third subject with the shared slots taken: %+v %v; want parked", d, err)
		}
		wg.Wait()
		// Both waiters are done: the shared slots are free again.
		if d, err := b.Admit(ctx, Request{Subject: "z", Caller: throttle.Caller{ID: "later"}}); err != nil || d.Outcome != Run {
			t.Errorf("after the waiters: %+v %v; want run after waiting", d, err)
		}
	})
}

// TestGateNoWaitWithoutSlot: at 50/s, turns are 20ms apart, well inside
// EarlyWait; still, of 10 jobs of one subject arriving at once only those
// holding one of its 2 waiting slots wait for a new turn (and the one whose
// turn is now runs): the others park, so a hot subject cannot keep the
// worker slots cycling through its own jobs while other subjects queue.
func TestGateNoWaitWithoutSlot(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rule := throttle.Rule{Name: "hot", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(50).WithBurst(1)}
		g := newGate(t, rdb, Options{EarlyWait: 500 * ms, Settings: Settings{MaxWait: time.Second, WaitSlots: 2}}, rule)
		ctx := context.Background()
		var mu sync.Mutex
		outcomes := map[Outcome]int{}
		var wg sync.WaitGroup
		for i := range 10 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := g.Admit(ctx, Request{Subject: "hot", Caller: throttle.Caller{ID: fmt.Sprint("job-", i)}})
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				outcomes[d.Outcome]++
				mu.Unlock()
			}()
		}
		wg.Wait()
		if outcomes[Run] > 3 || outcomes[Park] < 7 {
			t.Errorf("outcomes %v: want at most 3 run (one now, two in the waiting slots) and the rest parked", outcomes)
		}
	})
}

// serveLineUntilEmpty serves subject's line on g, as a wake-up loop would:
// first when serveAt says (a job that started the line), then at each
// serving's Next, handing each booked turn to its job's channel in woken
// (under mu), until a serving finds the line empty. It returns the count
// of servings, which goes on in the background.
func serveLineUntilEmpty(t *testing.T, ctx context.Context, g *Gate, subject string, serveAt <-chan time.Time, mu *sync.Mutex, woken map[string]chan time.Time) *atomic.Int32 {
	serves := new(atomic.Int32)
	go func() {
		next := <-serveAt
		for {
			time.Sleep(time.Until(next))
			s, err := g.Serve(ctx, subject)
			if err != nil {
				t.Errorf("Serve: %v", err)
				return
			}
			serves.Add(1)
			mu.Lock()
			for id, slot := range s.Handed {
				woken[id] <- slot
			}
			mu.Unlock()
			if s.Next.IsZero() {
				return
			}
			next = s.Next
		}
	}()
	return serves
}
