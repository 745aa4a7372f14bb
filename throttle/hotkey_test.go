package throttle

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// One hot GCRA key, 5,000 per second burst 10, 256 waiters over 4
// processes (limiters on their own clients): on the Redis clock no 1 s
// window admits more than limit + burst (issue 11.7). In the bubble a
// waiter wakes exactly at its Redis slot, so its wake time is the Redis
// clock. On a real server the bound holds on Redis's clock too
// (bench/results/2026-11-23-hotkey-5000.json: 5009 of 5010); the client's
// clock sees a few more, which is wake-up jitter, not admissions.
func TestHotKeyBoundOnRedisClock(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		const procs, waiters, limit, burst = 4, 256, 5000, 10
		rule := Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(limit).WithBurst(burst)}
		end := time.Now().Add(1100 * ms)
		var mu sync.Mutex
		var times []time.Duration
		var wg sync.WaitGroup
		for p := range procs {
			rdb := redistest.PipeClient(m)
			defer rdb.Close()
			l := mustNew(t, rdb, Options{}, rule)
			for range waiters / procs {
				wg.Go(func() {
					for time.Now().Before(end) {
						if err := l.Wait(context.Background(), "hot"); err != nil {
							t.Errorf("process %d: Wait: %v", p, err)
							return
						}
						mu.Lock()
						times = append(times, at())
						mu.Unlock()
					}
				})
			}
		}
		wg.Wait()
		slices.Sort(times)
		most, j := 0, 0
		for i := range times { // windows [times[i], times[i] + 1s)
			for j < len(times) && times[j] < times[i]+time.Second {
				j++
			}
			most = max(most, j-i)
		}
		if most > limit+burst || most < limit {
			t.Fatalf("most admissions in a 1s window on the Redis clock: %d, want at most %d (and about %d)", most, limit+burst, limit)
		}
		t.Logf("%d admissions; the most in 1s: %d of %d", len(times), most, limit+burst)
	})
}
