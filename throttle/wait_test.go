package throttle

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// 256 goroutines wait on one key. Each is started only once the previous
// one has its slot, which fixes the arrival order; every goroutine must be
// admitted exactly at its slot, in that order, after one round trip.
func TestWaitReservesSlotsInArrivalOrder(t *testing.T) {
	const waiters = 256
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		for _, burst := range []int{1, 10} {
			t.Run(string(algo)+"/burst"+formatInt(burst), func(t *testing.T) {
				virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
					l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(100).WithBurst(burst)})
					warm(t, l)
					calls := countScripts(rdb)
					admittedAt := waitInOrder(t, l, waiters)
					for i, got := range admittedAt {
						want := time.Duration(max(0, i-burst+1)) * 10 * ms
						if got != want {
							t.Fatalf("waiter %d admitted at %v, want %v", i, got, want)
						}
					}
					if got := calls.Load(); got != waiters {
						t.Fatalf("%d script calls for %d waiters, want exactly one each", got, waiters)
					}
				})
			})
		}
	}
}

// waitInOrder starts k goroutines that Wait on subject "s", each only once
// the previous one is blocked (holding its slot, or queued), which fixes
// the arrival order, and returns when each was admitted, from the start.
func waitInOrder(t *testing.T, l *Limiter, k int) []time.Duration {
	t.Helper()
	start := at()
	admittedAt := make([]time.Duration, k)
	var wg sync.WaitGroup
	for i := range k {
		wg.Go(func() {
			if err := l.Wait(context.Background(), "s"); err != nil {
				t.Errorf("waiter %d: %v", i, err)
			}
			admittedAt[i] = at() - start
		})
		synctest.Wait()
	}
	wg.Wait()
	return admittedAt
}

// Window limiters cannot reserve: waiters queue in the process and only the
// head asks Redis, at the moment a permit frees. Redis sees one call per
// admitted waiter plus one per refill.
func TestWaitWindowsQueueLocally(t *testing.T) {
	const waiters = 12
	for _, tc := range []struct {
		algo    Algorithm
		refills []time.Duration // when each batch of 5 is admitted
	}{
		{FixedWindow, []time.Duration{0, time.Second, 2 * time.Second}},
		{SlidingLog, []time.Duration{0, time.Second, 2 * time.Second}},
		// Precision 100ms: a bucket counts for period + precision.
		{SlidingWindow, []time.Duration{0, 1100 * ms, 2200 * ms}},
	} {
		t.Run(string(tc.algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: tc.algo, Limit: PerSecond(5), Precision: 100 * ms})
				warm(t, l)
				calls := countScripts(rdb)
				admittedAt := waitInOrder(t, l, waiters)
				for i, got := range admittedAt {
					if want := tc.refills[i/5]; got != want {
						t.Fatalf("waiter %d admitted at %v, want %v (all: %v)", i, got, want, admittedAt)
					}
				}
				// 12 admissions, and the head was denied once before each of
				// the two refills.
				if got, want := calls.Load(), int64(waiters+2); got != want {
					t.Fatalf("%d script calls, want %d", got, want)
				}
			})
		})
	}
}

// A wait that would end past the context's deadline fails at once, books
// nothing, and says when the permit would come.
func TestWaitPastDeadlineConsumesNothing(t *testing.T) {
	for _, algo := range rateAlgorithms() {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(1), Precision: 100 * ms})
				if err := l.Wait(context.Background(), "s"); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 500*ms)
				defer cancel()
				start := at()
				err := l.Wait(ctx, "s")
				var de *DelayError
				if !errors.As(err, &de) || !delayBy(err, true) {
					t.Fatalf("Wait past deadline: %v, want a *DelayError matching context.DeadlineExceeded", err)
				}
				want := time.Second
				if algo == SlidingWindow {
					want = 1100 * ms
				}
				if de.RetryAfter != want || de.Rule != "r" {
					t.Fatalf("DelayError %+v, want rule r, RetryAfter %v", de, want)
				}
				if at() != start {
					t.Fatalf("Wait took %v to fail; want at once", at()-start)
				}
				// Nothing was booked: the next permit still comes at 1s.
				if err := l.Wait(context.Background(), "s"); err != nil || at() != want {
					t.Fatalf("next Wait: err %v at %v, want admitted at %v", err, at(), want)
				}
			})
		})
	}
}

func TestWaitPastMaxWait(t *testing.T) {
	for _, algo := range rateAlgorithms() {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{MaxWait: 300 * ms}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(1)})
				if err := l.Wait(context.Background(), "s"); err != nil {
					t.Fatal(err)
				}
				err := l.Wait(context.Background(), "s")
				if !delayBy(err, false) {
					t.Fatalf("Wait past MaxWait: %v, want ErrMaxWait", err)
				}
				if at() != 0 {
					t.Fatalf("failed after %v, want at once", at())
				}
			})
		})
	}
}

// A waiter whose context is cancelled while it sleeps gives its slot back:
// the next waiter gets it.
func TestWaitCancelledRefunds(t *testing.T) {
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(10).WithBurst(1)})
				if err := l.Wait(context.Background(), "s"); err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error)
				go func() { done <- l.Wait(ctx, "s") }()
				time.Sleep(50 * ms) // the waiter holds the slot at 100ms
				cancel()
				if err := <-done; !errors.Is(err, context.Canceled) {
					t.Fatalf("cancelled Wait: %v, want context.Canceled", err)
				}
				if err := l.Wait(context.Background(), "s"); err != nil || at() != 100*ms {
					t.Fatalf("next Wait: err %v at %v, want the refunded slot at 100ms", err, at())
				}
			})
		})
	}
}

// Cancel refunds what no later reservation depends on, once.
func TestReservationCancel(t *testing.T) {
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: algo, Limit: PerSecond(10).WithBurst(1)})
				reserve := func() *Reservation {
					t.Helper()
					r, err := l.ReserveN(ctx, "s", 1)
					if err != nil {
						t.Fatal(err)
					}
					return r
				}
				if d := reserve().Delay(); d != 0 {
					t.Fatalf("first delay %v, want 0", d)
				}
				a, b := reserve(), reserve()
				if a.Delay() != 100*ms || b.Delay() != 200*ms {
					t.Fatalf("delays %v, %v; want 100ms, 200ms", a.Delay(), b.Delay())
				}
				// b is the latest: cancelling it frees its slot. Twice
				// refunds once.
				for range 2 {
					if err := b.Cancel(ctx); err != nil {
						t.Fatal(err)
					}
				}
				c := reserve()
				if c.Delay() != 200*ms {
					t.Fatalf("after cancelling the latest: delay %v, want 200ms", c.Delay())
				}
				// a is followed by c, whose slot assumed a's: nothing is
				// refunded, or a and c's successor would share a slot.
				if err := a.Cancel(ctx); err != nil {
					t.Fatal(err)
				}
				if d := reserve().Delay(); d != 300*ms {
					t.Fatalf("after cancelling an earlier one: delay %v, want 300ms", d)
				}
			})
		})
	}
}

// Windows reserve too: a reservation past the window's count books the
// next window's slot (their ledger of future admissions), and cancelling
// it before then gives the slot back.
func TestReserveOnWindows(t *testing.T) {
	for _, algo := range []Algorithm{FixedWindow, SlidingLog, SlidingWindow} {
		t.Run(string(algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, Rule{Name: "w", Algorithm: algo, Limit: Limit{Count: 2, Period: time.Second}})
				// The permits at 0 leave the window at 1s; sliding_window's
				// at the end of their bucket (precision 50ms) plus 1s.
				next := time.Second
				if algo == SlidingWindow {
					next += 50 * ms
				}
				for i, want := range []time.Duration{0, 0, next} {
					r, err := l.ReserveN(ctx, "s", 1)
					if err != nil || r.Delay() != want {
						t.Fatalf("reservation %d: %v, %v; want delay %v", i, r, err, want)
					}
					if i == 2 {
						if err := r.Cancel(ctx); err != nil {
							t.Fatal(err)
						}
					}
				}
				if r, err := l.ReserveN(ctx, "s", 1); err != nil || r.Delay() != next {
					t.Fatalf("after cancelling the third: %v, %v; want its slot at %v again", r, err, next)
				}
				if r, err := l.ReserveN(ctx, "s", 1); err != nil || r.Delay() != next {
					t.Fatalf("the fourth: %v, %v; want the second permit at %v", r, err, next)
				}
				if r, err := l.ReserveN(ctx, "s", 1); err != nil || r.Delay() != 2*next {
					t.Fatalf("the fifth: %v, %v; want the slot at %v", r, err, 2*next)
				}
			})
		})
	}
}

// A request larger than a rule can ever admit fails at once, without a
// round trip, instead of waiting for a slot that never comes.
func TestRequestOverCapacity(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		calls := countScripts(rdb)
		for _, tc := range []struct {
			rule Rule
			n    int
			cap  int
		}{
			{Rule{Name: "b", Algorithm: TokenBucket, Limit: PerSecond(10).WithBurst(3)}, 4, 3},
			{Rule{Name: "g", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(3)}, 4, 3},
			{Rule{Name: "f", Algorithm: FixedWindow, Limit: PerSecond(5).WithBurst(50)}, 6, 5},
			{Rule{Name: "l", Algorithm: SlidingLog, Limit: PerSecond(5)}, 6, 5},
			{Rule{Name: "w", Algorithm: SlidingWindow, Limit: PerSecond(5)}, 6, 5},
		} {
			l := mustNew(t, rdb, Options{}, tc.rule)
			for name, call := range map[string]func() error{
				"AllowN":   func() error { _, err := l.AllowN(context.Background(), "s", tc.n); return err },
				"WaitN":    func() error { return l.WaitN(context.Background(), "s", tc.n) },
				"ReserveN": func() error { _, err := l.ReserveN(context.Background(), "s", tc.n); return err },
			} {
				err := call()
				want := fmt.Sprintf("rule %q: %d permits requested, but it admits at most %d at once", tc.rule.Name, tc.n, tc.cap)
				if !errors.Is(err, ErrExceedsCapacity) || !strings.Contains(err.Error(), want) {
					t.Errorf("%s %s n=%d: %v, want ErrExceedsCapacity saying %q", tc.rule.Name, name, tc.n, err, want)
				}
			}
			if _, err := l.AllowN(context.Background(), "s", -1); err == nil || !strings.HasPrefix(err.Error(), "throttle: ") {
				t.Errorf("AllowN(-1) = %v, want a throttle error", err)
			}
		}
		if got := calls.Load(); got != 0 {
			t.Fatalf("%d script calls for invalid requests, want 0", got)
		}
	})
}

// A Wait whose context is already done returns at once.
func TestWaitContextAlreadyDone(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		calls := countScripts(rdb)
		for _, algo := range registered() {
			l := mustNew(t, rdb, Options{}, sampleRule("r", algo, PerSecond(1)))
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			if err := l.Wait(ctx, "s"); !errors.Is(err, context.Canceled) {
				t.Fatalf("%v: %v, want context.Canceled", algo, err)
			}
		}
		if calls.Load() != 0 {
			t.Fatalf("a done context still reached Redis")
		}
	})
}

// A window waiter that is not at the head of the queue gives up at its
// deadline without blocking the others.
func TestWindowQueueCancelledWaiterLeaves(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: FixedWindow, Limit: PerSecond(1)})
		if err := l.Wait(context.Background(), "s"); err != nil {
			t.Fatal(err)
		}
		head := make(chan error)
		go func() { head <- l.Wait(context.Background(), "s") }()
		synctest.Wait()
		ctx, cancel := context.WithCancel(context.Background())
		second := make(chan error)
		go func() { second <- l.Wait(ctx, "s") }()
		synctest.Wait()
		third := make(chan error)
		go func() { third <- l.Wait(context.Background(), "s") }()
		synctest.Wait()
		cancel()
		if err := <-second; !errors.Is(err, context.Canceled) {
			t.Fatalf("queued waiter: %v, want context.Canceled", err)
		}
		if err := <-head; err != nil || at() != time.Second {
			t.Fatalf("head: %v at %v, want admitted at 1s", err, at())
		}
		if err := <-third; err != nil || at() != 2*time.Second {
			t.Fatalf("third: %v at %v, want admitted at 2s", err, at())
		}
		l.queues.mu.Lock()
		defer l.queues.mu.Unlock()
		if len(l.queues.bySubject) != 0 {
			t.Fatalf("%d queues left after all waiters left", len(l.queues.bySubject))
		}
	})
}

// A queued window waiter whose deadline ends before the head's next
// permit fails at once, with the head's answer, instead of waiting in vain.
func TestWindowQueueFailsAtOnceWhenHeadLearnsTooLate(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: SlidingLog, Limit: PerSecond(1)})
		if err := l.Wait(context.Background(), "s"); err != nil {
			t.Fatal(err)
		}
		// A queued waiter first, then the head asks: it is denied until 1s.
		ctx, cancel := context.WithTimeout(context.Background(), 500*ms)
		defer cancel()
		head, short, long, mid := make(chan error), make(chan error), make(chan error), make(chan error)
		go func() { head <- l.Wait(context.Background(), "s") }()
		synctest.Wait()
		go func() { short <- l.Wait(ctx, "s") }()
		go func() {
			lctx, lcancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer lcancel()
			long <- l.Wait(lctx, "s")
		}()
		synctest.Wait()
		// Queued behind long, it can wait past 1s but not past 2s: it
		// learns so at 1s, when long becomes the head and is denied.
		go func() {
			mctx, mcancel := context.WithTimeout(context.Background(), 1500*ms)
			defer mcancel()
			mid <- l.Wait(mctx, "s")
		}()
		synctest.Wait()
		// The head's denial was announced before the short waiter queued;
		// it fails at once, at t=0, with the head's retry time.
		err := <-short
		var de *DelayError
		if !errors.As(err, &de) || !delayBy(err, true) || de.RetryAfter != time.Second || at() != 0 {
			t.Fatalf("short waiter: %v at %v, want a deadline DelayError of 1s at once", err, at())
		}
		if err := <-head; err != nil || at() != time.Second {
			t.Fatalf("head: %v at %v, want admitted at 1s", err, at())
		}
		if err := <-mid; !errors.As(err, &de) || !delayBy(err, true) || de.RetryAfter != time.Second || at() != time.Second {
			t.Fatalf("mid waiter: %v at %v, want a deadline DelayError of 1s, at 1s", err, at())
		}
		if err := <-long; err != nil || at() != 2*time.Second {
			t.Fatalf("long waiter: %v at %v, want admitted at 2s", err, at())
		}
	})
}
