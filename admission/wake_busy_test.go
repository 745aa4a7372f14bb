package admission

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// A backlog of 3,000 wake-ups at 50 a second, served by three processes
// each with its own client: every wake-up is woken exactly once, before
// its turn and no sooner than Lead before it, and the looks that take
// nothing are at most 0.2 per wake-up, with one shard and with three. On
// virtual time, so the counts are exact.
func TestWakeupsBusyLooks(t *testing.T) {
	for _, shards := range []int{1, 3} {
		t.Run(fmt.Sprintf("shards=%d", shards), func(t *testing.T) {
			redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				const tasks, rate = 3000, 50
				calls, woken := busyBacklog(t, m, shards, 3, tasks, rate)
				looks, empty, _ := calls.Counts()
				if len(woken) != tasks {
					t.Errorf("%d of %d wake-ups woken", len(woken), tasks)
				}
				for member, n := range woken {
					if n != 1 {
						t.Errorf("%s woken %d times, want once", member, n)
					}
				}
				if empty > tasks/5 {
					t.Errorf("%d looks took nothing, want at most %d (0.2 per wake-up)", empty, tasks/5)
				}
				t.Logf("%d shards, %d wake-ups at %d/s, 3 processes: %d looks (%.3f per wake-up), %d took nothing (%.3f per wake-up)",
					shards, tasks, rate, looks, float64(looks)/tasks, empty, float64(empty)/tasks)
			})
		})
	}
}

// busyBacklog adds tasks wake-ups at rate a second to a ledger of shards,
// runs wakers wakers until all are due, and returns their looks and how
// often each member was woken. A member woken outside [slot-Lead, slot]
// fails t.
func busyBacklog(t *testing.T, m *miniredis.Miniredis, shards, wakers, tasks, rate int) (*redistest.LedgerCalls, map[string]int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const key = "test:{wakeups}"
	cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms}
	adder := redistest.PipeClient(m)
	defer adder.Close()
	ledger, err := NewShardedWakeups(adder, key, shards)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now().Add(time.Second)
	slots := make(map[string]time.Time, tasks)
	for i := range tasks {
		slots[fmt.Sprintf("task-%d", i)] = start.Add(time.Duration(i) * time.Second / time.Duration(rate))
	}
	if err := ledger.AddAll(ctx, slots); err != nil {
		t.Fatal(err)
	}
	looks := redistest.CountLedger(ledger.Keys())
	var mu sync.Mutex
	woken := map[string]int{}
	wake := func(_ context.Context, member string) error {
		mu.Lock()
		defer mu.Unlock()
		woken[member]++
		if now, slot := time.Now(), slots[member]; now.Before(slot.Add(-cfg.Lead)) || now.After(slot) {
			t.Errorf("%s woken %v before its slot, want within %v", member, slot.Sub(now), cfg.Lead)
		}
		return nil
	}
	var wg sync.WaitGroup
	for range wakers {
		c := redistest.PipeClient(m)
		defer c.Close()
		c.AddHook(looks)
		w, _ := NewShardedWakeups(c, key, shards)
		wg.Add(1)
		go func() { defer wg.Done(); _ = w.Run(ctx, cfg, wake) }()
	}
	time.Sleep(time.Until(start.Add(time.Duration(tasks) * time.Second / time.Duration(rate))))
	cancel()
	wg.Wait()
	return looks, woken
}

// A waker that stops while it holds busy shards releases their watches and
// says so on their channels: the other takes them over within the release
// race (a quarter Idle). 600 wake-ups at 20/s over three shards and two
// wakers, the busier of which stops after 10 s: every wake-up is woken
// once, none later than an Idle after its slot, and all are on time again
// by 2 s after the stop.
func TestWakeupsBusyTakeover(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms, Idle: time.Second}
		takeover(t, m, rdb, 2, cfg, cfg.Idle, 2*time.Second, func(_, stop func()) { stop() })
	})
}

// takeover adds 600 wake-ups at 20/s to a ledger of three shards, runs
// wakers wakers over it, each with its own client, and 10 s in ends the
// one that took most in the second before with end (given the kill of
// its client and the stop of its Run). Every wake-up must be woken once,
// none later than bound after its slot, and those due settle after the
// end on time.
func takeover(t *testing.T, m *miniredis.Miniredis, rdb *redis.Client, wakers int, cfg RunOptions, bound, settle time.Duration, end func(kill, stop func())) {
	const key, tasks, rate = "test:{wakeups}", 600, 20
	ledger, _ := NewShardedWakeups(rdb, key, 3)
	start := time.Now().Add(time.Second)
	slots := make(map[string]time.Time, tasks)
	for i := range tasks {
		slots[fmt.Sprintf("task-%d", i)] = start.Add(time.Duration(i) * time.Second / rate)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := ledger.AddAll(ctx, slots); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	woken := map[string]time.Time{}
	took := make([]int, wakers) // by each waker, in the second before the end
	kills, stops := make([]func(), wakers), make([]context.CancelFunc, wakers)
	var wg sync.WaitGroup
	for i := range wakers {
		c, kill := killableClient(m)
		defer c.Close()
		w, _ := NewShardedWakeups(c, key, 3)
		runCtx, stop := context.WithCancel(ctx)
		defer stop()
		kills[i], stops[i] = kill, stop
		wake := func(_ context.Context, member string) error {
			mu.Lock()
			defer mu.Unlock()
			if _, again := woken[member]; again {
				t.Errorf("%s woken twice", member)
			}
			woken[member] = time.Now()
			took[i]++
			return nil
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = w.Run(runCtx, cfg, wake) }()
	}
	// Between two looks (the wake-ups fall due on a 50 ms grid): a kill
	// during a look loses what that look took, which its queue's own
	// schedule brings back (wake_run.go, Run).
	endAt := start.Add(10*time.Second + 25*ms)
	time.Sleep(time.Until(endAt.Add(-time.Second)))
	mu.Lock()
	clear(took)
	mu.Unlock()
	time.Sleep(time.Until(endAt))
	mu.Lock()
	busiest := 0 // the waker taking most: the holder of the busiest shards
	for i := range took {
		if took[i] > took[busiest] {
			busiest = i
		}
	}
	t.Logf("in the second before the end, the wakers took %v; ending waker %d", took, busiest)
	mu.Unlock()
	end(kills[busiest], stops[busiest])
	time.Sleep(time.Until(start.Add(tasks*time.Second/rate + bound + time.Second)))
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	late, worst := 0, time.Duration(0)
	for member, slot := range slots {
		at, ok := woken[member]
		switch {
		case !ok:
			t.Errorf("%s not woken", member)
		case at.After(slot.Add(bound)):
			t.Errorf("%s woken %v after its slot, want at most %v", member, at.Sub(slot), bound)
		case at.After(slot) && slot.After(endAt.Add(settle)):
			t.Errorf("%s (slot %v after the end) woken %v late, want on time", member, slot.Sub(endAt), at.Sub(slot))
		case at.After(slot):
			late++
			worst = max(worst, at.Sub(slot))
		}
	}
	if left, _ := ledger.Len(context.Background()); left != 0 {
		t.Errorf("%d wake-ups left in the ledger, want 0", left)
	}
	t.Logf("one of %d wakers ended: %d of %d wake-ups late, the latest by %v (bound %v)", wakers, late, tasks, worst, bound)
}
