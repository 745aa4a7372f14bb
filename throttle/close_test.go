package throttle

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// Close ends every goroutine and timer of a limiter, in every mode, with
// each mode's background work under way: after it, and after the time of
// every timer and lease, no goroutine of the limiter runs, and its calls
// return ErrClosed.
func TestCloseEndsGoroutines(t *testing.T) {
	modes := []struct {
		name  string
		opts  Options
		rules []Rule
		work  func(t *testing.T, l *Limiter)
	}{
		{"exact", Options{}, []Rule{{Name: "r", Algorithm: TokenBucket, Limit: PerSecond(1000)}}, func(t *testing.T, l *Limiter) {
			var wg sync.WaitGroup
			for range 32 { // batched Allows
				wg.Go(func() { _, _ = l.Allow(context.Background(), "s") })
			}
			wg.Wait()
			r, err := l.ReserveN(context.Background(), "s", 1)
			if err != nil {
				t.Fatalf("ReserveN: %v", err)
			}
			if err := r.Cancel(context.Background()); err != nil { // a refund
				t.Fatalf("Cancel: %v", err)
			}
		}},
		{"several subjects", Options{}, []Rule{
			{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10)},
			{Name: "global", Algorithm: SlidingLog, Limit: Limit{Count: 20, Period: time.Second}, Subject: "all"},
		}, func(t *testing.T, l *Limiter) {
			if err := l.Wait(context.Background(), "acme"); err != nil {
				t.Fatalf("Wait: %v", err)
			}
		}},
		{"concurrency", Options{}, []Rule{{Name: "c", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: time.Second}}}, func(t *testing.T, l *Limiter) {
			// A place held, and renewed, when Close comes.
			if err := l.Wait(context.Background(), "s"); err != nil {
				t.Fatalf("Wait: %v", err)
			}
		}},
		{"local lease", Options{LocalLease: leaseSlack}, []Rule{leasedRule}, func(t *testing.T, l *Limiter) {
			var wg sync.WaitGroup
			end := at() + 100*ms
			for range 16 { // demand enough to lease
				wg.Go(func() {
					for at() < end {
						_ = l.Wait(context.Background(), "hot")
					}
				})
			}
			wg.Wait()
		}},
	}
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, mode.opts, mode.rules...)
				mode.work(t, l)
				synctest.Wait() // every goroutine started is running
				if mode.name == "concurrency" && len(redistest.LimiterGoroutines()) == 0 {
					t.Fatal("no renewal goroutine found while a place is held: the check sees nothing")
				}
				if err := l.Close(); err != nil {
					t.Fatalf("Close: %v", err)
				}
				time.Sleep(10 * time.Second) // past every timer and lease
				synctest.Wait()
				if g := redistest.LimiterGoroutines(); len(g) > 0 {
					t.Fatalf("%d goroutines of the limiter after Close:\n%s", len(g), strings.Join(g, "\n\n"))
				}
				subject := "s"
				if _, err := l.Allow(context.Background(), subject); !errors.Is(err, ErrClosed) {
					t.Errorf("Allow after Close: %v, want ErrClosed", err)
				}
				if err := l.Wait(context.Background(), subject); !errors.Is(err, ErrClosed) {
					t.Errorf("Wait after Close: %v, want ErrClosed", err)
				}
				if _, err := l.Admit(context.Background(), AdmitRequest{Subject: subject, N: 1, Caller: Caller{ID: "a"}}); !errors.Is(err, ErrClosed) {
					t.Errorf("Admit after Close: %v, want ErrClosed", err)
				}
				if err := l.Close(); err != nil {
					t.Errorf("Close again: %v", err)
				}
			})
		})
	}
}

// A concurrency limiter closed with a place held stops renewing it: the
// place frees when its lease expires, and another process takes it.
func TestCloseStopsRenewing(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rule := Rule{Name: "c", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: time.Second}}
		l := mustNew(t, rdb, Options{}, rule)
		other := mustNew(t, rdb, Options{}, rule)
		defer other.Close()
		ctx := context.Background()
		if err := l.Wait(ctx, "s"); err != nil {
			t.Fatalf("Wait: %v", err)
		}
		time.Sleep(3 * time.Second) // renewed meanwhile
		a, err := other.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "b"}})
		if err != nil || a.Status != Booked {
			t.Fatalf("Admit while held: %+v, %v; want Booked", a, err)
		}
		_ = l.Close()
		time.Sleep(time.Until(a.At))
		a, err = other.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "b"}})
		if err != nil || a.Status != Granted {
			t.Fatalf("Admit a lease after Close: %+v, %v; want Granted", a, err)
		}
	})
}

// A Wait queued for a place when its limiter closes returns ErrClosed at
// once, and leaves the queue.
func TestCloseEndsWaitForPlace(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rule := Rule{Name: "c", Algorithm: Concurrency, Limit: Limit{Count: 1, Period: time.Minute}}
		holder := mustNew(t, rdb, Options{}, rule)
		defer holder.Close()
		l := mustNew(t, rdb, Options{}, rule)
		ctx := context.Background()
		if err := holder.Wait(ctx, "s"); err != nil {
			t.Fatalf("Wait: %v", err)
		}
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- l.Wait(ctx, "s") }()
		time.Sleep(time.Second)
		_ = l.Close()
		if err := <-done; !errors.Is(err, ErrClosed) {
			t.Fatalf("Wait: %v, want ErrClosed", err)
		}
		if waited := time.Since(start); waited != time.Second {
			t.Errorf("Wait returned after %v, want 1s (at Close)", waited)
		}
	})
}

// Close gives back the turns a leasing process holds and has not handed
// out: the bucket is then as if they had never been taken.
func TestCloseGivesLeasedTurnsBack(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		rule := Rule{Name: "hot", Algorithm: GCRA, Limit: PerSecond(1000).WithBurst(10)}
		p := newProc(t, m, rule)
		plain := mustNew(t, rdb, Options{}, rule)
		allow(t, plain, "hot", 10) // the lease's turns lie ahead
		takeLease(t, leaserOf(p.lim), "hot", 8)
		_ = p.lim.Close()
		if got := p.calls.get("refund"); got != 1 {
			t.Fatalf("%d refund calls at Close, want 1 (ops %v)", got, p.calls.snapshot())
		}
		time.Sleep(10 * ms) // the 10 taken before the lease are due again
		if got := admitted(t, plain, "hot", 20); got != 10 {
			t.Fatalf("%d admitted after Close, want 10: the lease's 8 turns given back", got)
		}
	})
}
