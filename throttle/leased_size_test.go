package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// hotLeaser is the leaser of a limiter of 100,000 a second, burst 100,
// with LocalLease leaseSlack, on a miniredis of its own.
func hotLeaser(t *testing.T) *leaser {
	rule := Rule{Name: "hot", Algorithm: GCRA, Limit: PerSecond(100_000).WithBurst(100)}
	rdb := redistest.PipeClient(miniredis.RunT(t))
	t.Cleanup(func() { rdb.Close() })
	return leaserOf(mustNew(t, rdb, Options{LocalLease: leaseSlack}, rule))
}

// A lease covers what arrives during two refills, a refill being the time
// from deciding a lease call to serving its queue (on a loaded machine,
// far longer than the round trip): at a served demand of 15,000 a second
// of a 100,000 limit and refills of 3 ms, 90 permits, less the most that
// arrivals at that demand can take before a slot is δ late (88); quiet
// (refills of 150 µs), the even-shares term (48) as before.
func TestLeaseSizedToRefills(t *testing.T) {
	q := hotLeaser(t)
	t0 := time.Unix(1_000_000, 0)
	// 1,500 permits asked for in the last demandWindow: 15,000 a second.
	k := &leasedKey{win: t0, prev: 1500}
	for _, c := range []struct {
		name   string
		refill time.Duration
		want   int
	}{
		{"quiet", 150 * time.Microsecond, 48},
		{"loaded", 3 * ms, 88},
		{"loaded, under the drop bound", 2 * ms, 60},
	} {
		t.Run(c.name, func(t *testing.T) {
			q.refill.Store(int64(c.refill))
			if got := q.size(k, t0); got != c.want {
				t.Errorf("size at 15,000/s with refills of %v = %d, want %d", c.refill, got, c.want)
			}
		})
	}
}

// Callers waiting on the exact path count as demand: a process whose
// served demand fell to 640 a second of a 100,000 limit (every request a
// slow Redis round trip) leases again, as many slots as its 32 callers on
// the exact path asked for, where the arrivals alone (at most δ·r = 3
// slots before a slot is δ late) justify no lease, and it would stay on
// the exact path.
func TestLeaseCountsCallersOnExactPath(t *testing.T) {
	q := hotLeaser(t)
	t0 := time.Unix(1_000_000, 0)
	sizeAt640 := func() int {
		k := q.lock("hot")
		defer k.mu.Unlock()
		k.win, k.prev, k.cur = t0, 64, 0 // 64 in the last 100 ms
		return q.size(k, t0)
	}
	if got := sizeAt640(); got != 0 {
		t.Fatalf("size at 640/s, nobody on the exact path = %d, want 0 (no lease)", got)
	}
	done := make([]func(), 32)
	for i := range done {
		done[i] = q.onExact("hot", 1)
	}
	if got := sizeAt640(); got != 32 {
		t.Errorf("size at 640/s with 32 callers on the exact path = %d, want 32", got)
	}
	for _, f := range done {
		f()
	}
	if got := sizeAt640(); got != 0 {
		t.Errorf("size at 640/s once the exact calls returned = %d, want 0", got)
	}
}

// The refill latency is measured from the moment a lease call is decided
// to the moment its reply serves the queue, so it includes the waits
// around the round trip: a call decided 2 ms before it was made counts
// 2 ms (on the bubble's clock), an eighth of it in the moving average.
func TestRefillLatencyFromDecision(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		p := newProc(t, m, leasedRule)
		q := leaserOf(p.lim)
		k := q.lock("hot")
		k.mu.Unlock()
		decided := time.Now()
		time.Sleep(2 * ms)
		q.call(context.Background(), "hot", k, 10, decided)
		if got, want := q.refillLatency(), 2*ms/8; got != want {
			t.Errorf("refill latency %v, want %v", got, want)
		}
	})
}
