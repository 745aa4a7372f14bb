package throttle

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// A global rule plus a per-tenant rule: a request is charged to both or to
// neither.
func TestGroupAllowRefundsEarlierParts(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		tenant := mustNew(t, rdb, Options{}, Rule{Name: "tenant", Algorithm: FixedWindow, Limit: PerMinute(5)})
		global := mustNew(t, rdb, Options{}, Rule{Name: "global", Algorithm: SlidingLog, Limit: PerMinute(2)})
		g, err := NewGroup(Part{Limiter: tenant}, Part{Limiter: global, Subject: Fixed("all")})
		if err != nil {
			t.Fatal(err)
		}
		for _, sub := range []string{"a", "b"} {
			if res, err := g.Allow(ctx, sub); err != nil || !res.Allowed {
				t.Fatalf("Allow(%s): %+v, %v; want allowed", sub, res, err)
			}
		}
		res, err := g.Allow(ctx, "c")
		if err != nil || res.Allowed || res.Rule != "global" || res.RetryAfter != time.Minute {
			t.Fatalf("third tenant: %+v, %v; want denied by global for 1m", res, err)
		}
		// c's tenant permit was refunded: all 5 are there.
		if got := allow(t, tenant, "c", 5); !got.Allowed {
			t.Fatalf("tenant c after the denied group request: %+v, want 5 permits left", got)
		}
	})
}

// Group.Wait reserves every bucket part without sleeping, then sleeps once,
// until the latest slot.
func TestGroupWaitSleepsUntilLatestSlot(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		tenant := mustNew(t, rdb, Options{}, Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		global := mustNew(t, rdb, Options{}, Rule{Name: "global", Algorithm: TokenBucket, Limit: PerSecond(4).WithBurst(1)})
		g, err := NewGroup(Part{Limiter: tenant}, Part{Limiter: global, Subject: Fixed("all")})
		if err != nil {
			t.Fatal(err)
		}
		var times []time.Duration
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, tenant := range []string{"a", "a", "b", "c"} {
			wg.Go(func() {
				if err := g.Wait(ctx, tenant); err != nil {
					t.Error(err)
				}
				mu.Lock()
				times = append(times, at())
				mu.Unlock()
			})
			synctest.Wait()
		}
		wg.Wait()
		want := []time.Duration{0, 250 * ms, 500 * ms, 750 * ms}
		for i := range want {
			if times[i] != want[i] {
				t.Fatalf("admissions at %v, want %v (the global 4/s paces everyone)", times, want)
			}
		}
	})
}

// If a later part cannot admit before the deadline, the earlier parts'
// reservations are refunded.
func TestGroupWaitFailureRefunds(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		tenant := mustNew(t, rdb, Options{}, Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		global := mustNew(t, rdb, Options{}, Rule{Name: "global", Algorithm: FixedWindow, Limit: PerMinute(1)})
		g, err := NewGroup(Part{Limiter: tenant}, Part{Limiter: global, Subject: Fixed("all")})
		if err != nil {
			t.Fatal(err)
		}
		if err := g.Wait(context.Background(), "a"); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if err := g.Wait(ctx, "a"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait: %v, want a deadline error from the global window", err)
		}
		// The tenant's slot at 100ms was given back.
		r, err := tenant.Reserve(context.Background(), "a")
		if err != nil || r.Delay() != 100*ms {
			t.Fatalf("tenant reservation after the failed group wait: %v, %v; want delay 100ms", r, err)
		}
	})
}

func TestNewGroupRejectsNil(t *testing.T) {
	if _, err := NewGroup(); err == nil {
		t.Fatal("NewGroup() succeeded, want an error")
	}
	if _, err := NewGroup(Part{}); err == nil {
		t.Fatal("NewGroup(Part{}) succeeded, want an error")
	}
}
