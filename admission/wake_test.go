package admission

import (
	"context"
	"fmt"
	"strings"
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

// TestWakeupsIdle: two wakers over an empty ledger look at it once a
// second each (Idle), not once a Tick, with one shard or three (past the
// look at every shard when they start); a wake-up added while they sleep
// is published, so it is still woken on time, within a tick of its slot
// less the lead, whether it is due before their next look or after it.
func TestWakeupsIdle(t *testing.T) {
	for _, shards := range []int{1, 3} {
		t.Run(fmt.Sprintf("shards=%d", shards), func(t *testing.T) { testWakeupsIdle(t, shards) })
	}
}

func testWakeupsIdle(t *testing.T, shards int) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		other := redistest.PipeClient(m)
		defer other.Close()
		// The script loaded first: a first EVALSHA answered NOSCRIPT is
		// sent again as EVAL, two calls for one look.
		if err := wakePopScript.Load(ctx, rdb).Err(); err != nil {
			t.Fatal(err)
		}
		looks := redistest.CountScripts(rdb)
		looks.Count(other)
		cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms}
		var mu sync.Mutex
		woken := map[string]time.Time{}
		wake := func(_ context.Context, member string) error {
			mu.Lock()
			defer mu.Unlock()
			woken[member] = time.Now()
			return nil
		}
		var wg sync.WaitGroup
		for _, c := range []*redis.Client{rdb, other} {
			w, _ := NewShardedWakeups(c, "test:{wakeups}", shards)
			wg.Add(1)
			go func() { defer wg.Done(); _ = w.Run(ctx, cfg, wake) }()
		}
		time.Sleep(500 * ms) // both have looked at every shard once
		looks.Store(0)
		time.Sleep(10 * time.Second)
		if n := looks.Load(); n > 2*11 {
			t.Errorf("%d looks in 10s by two idle wakers over %d shards, want at most 22 (one a second each)", n, shards)
		}
		t.Logf("two idle wakers over %d shards: %d looks in 10s", shards, looks.Load())

		adder, _ := NewShardedWakeups(redistest.PipeClient(m), "test:{wakeups}", shards)
		start := time.Now()
		slots := map[string]time.Time{"soon": start.Add(300 * ms), "later": start.Add(2500 * ms)}
		for member, at := range slots {
			if err := adder.Add(ctx, member, at); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(3 * time.Second)
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for member, slot := range slots {
			due := slot.Add(-cfg.Lead)
			if at, ok := woken[member]; !ok || at.Before(due) || at.After(due.Add(cfg.Tick)) {
				t.Errorf("%q woken at %v (woken: %v), want within a tick after %v", member, at.Sub(start), ok, due.Sub(start))
			}
		}
	})
}

// A user whose ACL grants no channels still adds wake-ups (the script's
// PUBLISH is refused, not its ZADD) and still wakes them on time: Run
// says it cannot subscribe and looks every tick instead. Real Redis: ACLs.
func TestWakeupsWithoutChannels(t *testing.T) {
	srv := redistest.Server(t)
	admin := srv.Client(t)
	if err := admin.Do(context.Background(), "ACL", "SETUSER", "nochan", "on", ">pw", "~*", "resetchannels", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Username: "nochan", Password: "pw"})
	defer rdb.Close()
	w, err := NewWakeups(rdb, redistest.Prefix(t)+"{wakeups}")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var reported []error
	woken := make(chan time.Time, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = w.Run(ctx, RunOptions{Lead: 50 * ms, Tick: 50 * ms, Idle: time.Minute, OnError: func(err error) {
			mu.Lock()
			defer mu.Unlock()
			reported = append(reported, err)
		}}, func(context.Context, string) error { woken <- time.Now(); return nil })
	}()
	time.Sleep(200 * ms) // Run has subscribed, or failed to, and sleeps
	slot := time.Now().Add(300 * ms)
	if err := w.Add(ctx, "m", slot); err != nil {
		t.Fatalf("Add without channels: %v", err)
	}
	select {
	case at := <-woken:
		// A look every tick: woken about a tick after its slot less the
		// lead, not at the next idle look, a minute later.
		if d := at.Sub(slot.Add(-50 * ms)); d > 3*time.Second {
			t.Errorf("woken %v after its slot less the lead, want within a few ticks", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("not woken within 10s: Run did not fall back to a look every tick")
	}
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	if len(reported) == 0 || !strings.Contains(reported[0].Error(), "may not subscribe") {
		t.Errorf("reported %v, want that it may not subscribe", reported)
	}
}
