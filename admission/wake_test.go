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

// TestWakeupsOnce runs two wakers (two processes' clients) over one ledger
// of 200 wake-ups spread over 2s: each member is woken exactly once, by
// one of them, between its slot less the lead and one tick after that; a
// member whose wake says "later" is woken again one tick later.
func TestWakeupsOnce(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		w, err := NewWakeups(rdb, "test:{wakeups}")
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		slots := map[string]time.Time{}
		for i := range 200 {
			member := Member("default", fmt.Sprintf("task-%d", i))
			slots[member] = start.Add(time.Duration(300+i*10) * ms)
			if err := w.Add(ctx, member, slots[member]); err != nil {
				t.Fatal(err)
			}
		}
		if ttl := m.TTL("test:{wakeups}"); ttl < time.Hour {
			t.Errorf("ledger TTL %v, want at least an hour past the last wake-up", ttl)
		}
		cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms}
		var mu sync.Mutex
		woken := map[string][]time.Time{}
		later := Member("default", "task-7")
		wake := func(_ context.Context, member string) error {
			mu.Lock()
			defer mu.Unlock()
			woken[member] = append(woken[member], time.Now())
			if member == later && len(woken[member]) == 1 {
				return fmt.Errorf("still active: %w", ErrWakeLater)
			}
			return nil
		}
		other := redistest.PipeClient(m)
		defer other.Close()
		w2, _ := NewWakeups(other, "test:{wakeups}")
		var wg sync.WaitGroup
		for _, x := range []*Wakeups{w, w2} {
			wg.Add(1)
			go func() { defer wg.Done(); _ = x.Run(ctx, cfg, wake) }()
		}
		time.Sleep(3 * time.Second)
		cancel()
		wg.Wait()
		for member, slot := range slots {
			times := woken[member]
			want := 1
			if member == later {
				want = 2
			}
			if len(times) != want {
				t.Errorf("%q woken %d times, want %d", member, len(times), want)
				continue
			}
			due := slot.Add(-cfg.Lead)
			if times[0].Before(due) || times[0].After(due.Add(cfg.Tick)) {
				t.Errorf("%q woken at %v, want within a tick after %v", member, times[0].Sub(start), due.Sub(start))
			}
			if want == 2 {
				if d := times[1].Sub(times[0]); d < cfg.Tick || d > 2*cfg.Tick {
					t.Errorf("woken again %v after 'later', want one to two ticks", d)
				}
			}
		}
		if n, _ := w.Len(context.Background()); n != 0 {
			t.Errorf("%d wake-ups left in the ledger", n)
		}
	})
}

func TestMemberSplit(t *testing.T) {
	for _, parts := range [][]string{{"default", "id"}, {"q:1", "a:b:c"}, {"", "x"}, {"ünï", "\x00"}} {
		got, ok := Split(Member(parts...))
		if !ok || fmt.Sprint(got) != fmt.Sprint(parts) {
			t.Errorf("Split(Member(%q)) = %q, %v", parts, got, ok)
		}
	}
	for _, bad := range []string{"x", "5:ab", ":a", "-1:"} {
		if _, ok := Split(bad); ok {
			t.Errorf("Split(%q): ok", bad)
		}
	}
}
