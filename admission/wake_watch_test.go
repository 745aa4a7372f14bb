package admission

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// The looks at a busy ledger do not grow with the processes waking it:
// 2,000 wake-ups at 200/s over three shards, woken by 3 processes and by
// 30, each wake-up once and on time, and the 30 look no more than the 3
// (give or take their first looks and their standby checks). Idle, 30
// processes cost Redis about what 3 do, not ten times as much. On virtual
// time, so the counts are exact.
func TestWakeupsLooksDoNotGrowWithWakers(t *testing.T) {
	const tasks, rate = 2000, 200
	looks := map[int]int{}
	for _, wakers := range []int{3, 30} {
		redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
			calls, woken := busyBacklog(t, m, 3, wakers, tasks, rate)
			n, empty, _ := calls.Counts()
			if len(woken) != tasks {
				t.Errorf("%d wakers: %d of %d wake-ups woken", wakers, len(woken), tasks)
			}
			for member, k := range woken {
				if k != 1 {
					t.Errorf("%d wakers: %s woken %d times, want once", wakers, member, k)
				}
			}
			looks[wakers] = n
			t.Logf("%d wakers, %d wake-ups at %d/s over 3 shards: %d looks (%.3f per wake-up), %d took nothing",
				wakers, tasks, rate, n, float64(n)/tasks, empty)
		})
	}
	// The 27 more wakers' first looks at each shard, and a standby check
	// of each shard each half Idle (1 s) over the 10 s.
	if extra := looks[30] - looks[3]; extra > 27*3+3*10 {
		t.Errorf("30 wakers looked %d times, 3 wakers %d: %d more, want at most %d", looks[30], looks[3], extra, 27*3+3*10)
	}
	if perTask := float64(looks[30]) / tasks; perTask > 0.4 {
		t.Errorf("30 wakers: %.3f looks per wake-up, want at most 0.4 (a look per shard per tick, 60 a second, for 200 wake-ups a second)", perTask)
	}

	idle := map[int]int64{}
	for _, wakers := range []int{3, 30} {
		redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if err := wakePopScript.Load(ctx, rdb).Err(); err != nil {
				t.Fatal(err)
			}
			calls := redistest.CountScripts(rdb)
			var wg sync.WaitGroup
			for range wakers {
				c := redistest.PipeClient(m)
				defer c.Close()
				calls.Count(c)
				w, _ := NewShardedWakeups(c, "test:{wakeups}", 3)
				wg.Add(1)
				go func() {
					defer wg.Done()
					_ = w.Run(ctx, RunOptions{}, func(context.Context, string) error { return nil })
				}()
			}
			time.Sleep(10 * time.Second) // past the first looks and checks
			calls.Store(0)
			time.Sleep(60 * time.Second)
			idle[wakers] = calls.Load()
			cancel()
			wg.Wait()
			t.Logf("%d idle wakers: %d calls in 60 s (%.3f per waker a second)", wakers, idle[wakers], float64(idle[wakers])/float64(wakers)/60)
		})
	}
	// Each shard's holder looks once per Idle × shards (6 s) and the
	// fleet checks each shard's watch at most once per half Idle (1 s):
	// at most 3/6 + 3/1 calls a second, whatever the wakers, give or take
	// a few at the window's edges (30 wakers cost 900 calls before watches).
	if want := int64(60*7/2 + 12); idle[30] > want {
		t.Errorf("30 idle wakers made %d calls in 60 s, want at most %d (3.5 a second, and the edges)", idle[30], want)
	}
	if per := float64(idle[3]) / 3 / 60; per > 1 {
		t.Errorf("3 idle wakers: %.3f calls per waker a second, want at most 1", per)
	}
}

// A process that holds shards' watches and is killed between two looks (its
// connections cut and its loop cancelled, so it releases nothing) loses no
// wake-up: 600 wake-ups at 20/s over three shards and three wakers; 10 s
// in, the busiest waker is killed. Each wake-up is woken exactly once, and
// its shards are taken over within a half Idle of the look it missed and a
// standby's check (two standbys, each checking a shard at least every
// Idle × shards, 3 s: one a 1.5 s), so none is woken later than 2 Idles
// after its slot, and all are on time again after that.
func TestWakeupsHolderKilled(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		cfg := RunOptions{Lead: 250 * ms, Tick: 50 * ms, Idle: time.Second}
		bound := 2 * cfg.Idle
		takeover(t, m, rdb, 3, cfg, bound, bound, func(kill, stop func()) { kill(); stop() })
	})
}

// killableClient returns a client of m (as redistest.PipeClient) and a
// kill that cuts its connections and refuses new ones: the client's
// process is gone, without a word to Redis.
func killableClient(m *miniredis.Miniredis) (*redis.Client, func()) {
	var mu sync.Mutex
	var conns []net.Conn
	dead := false
	c := redis.NewClient(&redis.Options{
		Addr:     "127.0.0.1:0",
		PoolSize: redistest.BubblePoolSize,
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			mu.Lock()
			defer mu.Unlock()
			if dead {
				return nil, errors.New("killed")
			}
			cn, err := m.Dial()
			if err == nil {
				conns = append(conns, cn)
			}
			return cn, err
		},
	})
	return c, func() {
		mu.Lock()
		defer mu.Unlock()
		dead = true
		for _, cn := range conns {
			_ = cn.Close()
		}
	}
}

// A holder killed before a wake-up is due (its connections cut and its
// loop cancelled, so it releases nothing) is replaced when that wake-up is
// overdue by the grace, not when its watch lapses: the standbys judge it by
// the work it missed. The holder is killed a second before the wake-up is
// due; the standbys learned of the wake-up either at their first check of
// the shard (it was in the ledger when they started; due 8.5 s after) or,
// added 2 s after their checks, from the shard's channel, which names the
// latest standby to check (due 5 s after, before any checks again). Either
// way the wake-up is woken once, a grace (500 ms) after it was due, where
// the watch (ending half an Idle after the holder's planned look) and the
// standbys' next checks (6 s apart each, with the defaults: at 6, 7, 12
// and 13 s) made it 3.5 s and 1 s late. On virtual time, so the instants
// are exact.
func TestWakeupsHolderKilledBeforeDue(t *testing.T) {
	for _, tc := range []struct {
		name         string
		addedAt, due time.Duration // after the standbys start; added < 0: before
	}{
		{"seen at a check", -time.Second, 8500 * ms},
		// Due before any standby checks again: only the channel tells.
		{"told on the channel", 2 * time.Second, 5 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				holderKilledBeforeDue(t, m, rdb, tc.addedAt, tc.due)
			})
		})
	}
}

// holderKilledBeforeDue runs a holder and, from start, two standbys over a
// ledger of three shards; adds a wake-up due at start+dueIn at addedAt
// (before start if < 0), kills the holder a second before it is due, and
// fails t unless the wake-up is woken once, within the grace and a Tick of
// when it was due.
func holderKilledBeforeDue(t *testing.T, m *miniredis.Miniredis, rdb *redis.Client, addedAt, dueIn time.Duration) {
	const key, member = "test:{wakeups}", "task-1"
	opts := RunOptions{}.withDefaults()
	ledger, _ := NewShardedWakeups(rdb, key, 3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now().Add(time.Second) // the standbys start
	due := start.Add(dueIn)              // the member's slot less the lead
	add := func() {
		if err := ledger.Add(ctx, member, due.Add(opts.Lead)); err != nil {
			t.Error(err)
		}
	}
	if addedAt < 0 {
		add()
	}
	var mu sync.Mutex
	woken := map[string][]time.Time{}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	run := func(c *redis.Client, ctx context.Context) {
		w, _ := NewShardedWakeups(c, key, 3)
		wg.Go(func() {
			_ = w.Run(ctx, RunOptions{}, func(_ context.Context, m string) error {
				mu.Lock()
				defer mu.Unlock()
				woken[m] = append(woken[m], time.Now())
				return nil
			})
		})
	}
	holder, kill := killableClient(m)
	defer holder.Close()
	holderCtx, stopHolder := context.WithCancel(ctx)
	defer stopHolder()
	run(holder, holderCtx) // first: it takes every shard's watch
	time.Sleep(time.Until(start))
	for range 2 {
		c := redistest.PipeClient(m)
		defer c.Close()
		run(c, ctx)
	}
	if addedAt >= 0 {
		time.Sleep(time.Until(start.Add(addedAt)))
		add()
	}
	time.Sleep(time.Until(due.Add(-time.Second)))
	kill()
	stopHolder()
	time.Sleep(time.Until(due.Add(10 * time.Second)))
	cancel()
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	got := woken[member]
	if len(got) != 1 {
		t.Fatalf("%s woken %d times, want once", member, len(got))
	}
	grace := newRunSchedule(3, opts, true, time.Now()).grace()
	if late, most := got[0].Sub(due), grace+opts.Tick; late > most {
		t.Errorf("%s woken %v after it was due, want at most %v (the grace and a Tick)", member, late, most)
	}
	t.Logf("holder killed 1 s before the wake-up was due: woken %v after it was due (grace %v)", got[0].Sub(due), grace)
}

// Only a released watch's taking is announced ("taken" ends the standbys'
// race after a release): a watch taken first, or from a holder whose work
// is overdue (dead or stalled), says nothing, so that a stalled machine's
// takeovers do not each reach every process of the fleet.
func TestWakeupsTakenOnlyAfterRelease(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		w, _ := NewShardedWakeups(rdb, "test:{wakeups}", 1)
		sub := rdb.Subscribe(ctx, w.keys[0])
		defer sub.Close()
		if _, err := sub.Receive(ctx); err != nil {
			t.Fatal(err)
		}
		msgs := sub.Channel()
		opts := RunOptions{}.withDefaults()
		s := newRunSchedule(1, opts, true, time.Now())
		look := func(id string) lookReply {
			r, err := w.look(ctx, 0, id, opts.Lead, s)
			if err != nil {
				t.Fatal(err)
			}
			return r
		}
		said := func() (taken int) {
			synctest.Wait() // every message published is delivered
			for {
				select {
				case msg := <-msgs:
					if msg.Payload == "taken" {
						taken++
					}
				default:
					return taken
				}
			}
		}
		if r := look("a"); !r.held || said() != 0 {
			t.Fatalf("first look: held %v; want the watch taken without a word", r.held)
		}
		if err := w.Add(ctx, "job", time.Now().Add(opts.Lead)); err != nil {
			t.Fatal(err)
		}
		said()
		time.Sleep(s.grace()) // "a" does not look: the wake-up is overdue
		if r := look("b"); !r.held || len(r.members) != 1 || said() != 0 {
			t.Fatalf("a look with the wake-up overdue: held %v, took %v; want the watch and the wake-up taken without a word", r.held, r.members)
		}
		w.release(ctx, []int{0}, "b", func(err error) { t.Error(err) })
		if r := look("a"); !r.held || said() != 1 {
			t.Fatalf("a look after the release: held %v; want the watch taken and said so once", r.held)
		}
	})
}
