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
				calls, woken := busyBacklog(t, m, shards, tasks, rate)
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
// runs three wakers until all are due, and returns their looks and how
// often each member was woken. A member woken outside [slot-Lead, slot]
// fails t.
func busyBacklog(t *testing.T, m *miniredis.Miniredis, shards, tasks, rate int) (*redistest.LedgerCalls, map[string]int) {
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
	for range 3 {
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

// A waker that stops while it takes a busy shard's wake-ups leaves them to
// the others, which had left that shard to it: they look there once per
// Idle, so they take over within an Idle. 600 wake-ups at 20/s over three
// shards and two wakers, one of which stops after 10 s: every wake-up is
// woken once, none later than an Idle after its slot, and all are on time
// again by 2 s after the stop.
func TestWakeupsBusyTakeover(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		const key, tasks, rate = "test:{wakeups}", 600, 20
		cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms, Idle: time.Second}
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
		var took [2]int // by each waker, in the second before the stop
		var stops [2]context.CancelFunc
		var wg sync.WaitGroup
		for i := range 2 {
			c := redistest.PipeClient(m)
			defer c.Close()
			w, _ := NewShardedWakeups(c, key, 3)
			runCtx, stop := context.WithCancel(ctx)
			defer stop()
			stops[i] = stop
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
		stopAt := start.Add(10 * time.Second)
		time.Sleep(time.Until(stopAt.Add(-time.Second)))
		mu.Lock()
		took = [2]int{}
		mu.Unlock()
		time.Sleep(time.Until(stopAt))
		mu.Lock()
		busiest := 0 // the waker taking most: the one the other left shards to
		if took[1] > took[0] {
			busiest = 1
		}
		t.Logf("in the second before the stop, the wakers took %v; stopping waker %d", took, busiest)
		mu.Unlock()
		stops[busiest]()
		time.Sleep(time.Until(start.Add(tasks*time.Second/rate + time.Second)))
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		late := 0
		for member, slot := range slots {
			at, ok := woken[member]
			switch {
			case !ok:
				t.Errorf("%s not woken", member)
			case at.After(slot.Add(cfg.Idle)):
				t.Errorf("%s woken %v after its slot, want at most an Idle (%v)", member, at.Sub(slot), cfg.Idle)
			case at.After(slot) && slot.After(stopAt.Add(2*time.Second)):
				t.Errorf("%s (slot %v after the stop) woken %v late, want on time", member, slot.Sub(stopAt), at.Sub(slot))
			case at.After(slot):
				late++
			}
		}
		t.Logf("one of two wakers stopped: %d of %d wake-ups late, all within an Idle", late, tasks)
	})
}
