package admission

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// On a Redis Cluster of its own (3 masters), three wakers of a 3-shard
// ledger each hold one subscription on every master, not all on the master
// of shard 0; wake-ups added to idle wakers (their idle looks a minute
// apart) are woken on time whether the adder is of this version (the
// script's SPUBLISH, on the shard's master) or of the one before (ZADD and
// a plain PUBLISH: a rolling upgrade).
func TestWakeupsShardChannelsCluster(t *testing.T) {
	cluster := redistest.Cluster(t, 3, 0)
	name := "waker-" + fmt.Sprint(time.Now().UnixNano())
	var clients []redis.UniversalClient
	for range 4 {
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs(), ClientName: name})
		t.Cleanup(func() { _ = c.Close() })
		clients = append(clients, c)
	}
	perMaster := func(t *testing.T) map[string]int {
		out := map[string]int{}
		for _, n := range cluster.Nodes {
			list, err := n.Client(t).ClientList(context.Background()).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(list, "\n") {
				if strings.Contains(line, "name="+name+" ") && !strings.Contains(line, "sub=0 psub=0 ssub=0") {
					out[n.Addr()]++
				}
			}
		}
		return out
	}
	testShardChannels(t, clients, func(t *testing.T) {
		got := perMaster(t)
		if len(got) != 3 {
			t.Errorf("the wakers' subscriptions are on %d masters (%v), want 3", len(got), got)
		}
		for addr, n := range got {
			if n != 3 {
				t.Errorf("master %s holds %d of the wakers' subscriptions, want 3 (one each)", addr, n)
			}
		}
		t.Logf("subscriptions per master: %v", got)
	})
}

// On a single Redis, a waker of a 3-shard ledger holds one subscription
// for all shards, and wakes on time the wake-ups added by this version
// and by the one before.
func TestWakeupsShardChannelsSingle(t *testing.T) {
	srv := redistest.Server(t)
	var clients []redis.UniversalClient
	for range 2 {
		clients = append(clients, srv.Client(t))
	}
	testShardChannels(t, clients, func(t *testing.T) {
		list, err := srv.Client(t).ClientList(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		if subs := strings.Count(list, " ssub=3 "); subs != 1 {
			t.Errorf("%d connections subscribed to the 3 shard channels, want 1:\n%s", subs, list)
		}
	})
}

// testShardChannels runs one idle waker on clients[1] (the others, if
// any, too) over a 3-shard ledger, checks where they subscribed with
// check, then adds to each shard one wake-up through Add and one as a
// process of the version before did (ZADD, then PUBLISH on the key's
// channel), and wants each woken within a second of its slot less the
// lead, not at the next idle look a minute later.
func testShardChannels(t *testing.T, clients []redis.UniversalClient, check func(t *testing.T)) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	base := redistest.Prefix(t) + "{wakeups}"
	ledger, err := NewShardedWakeups(clients[0], base, 3)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	woken := map[string]time.Time{}
	var runs sync.WaitGroup
	cfg := RunOptions{Idle: time.Minute, OnError: func(err error) { t.Error(err) }}
	for _, c := range clients[1:] {
		w, _ := NewShardedWakeups(c, base, 3)
		runs.Add(1)
		go func() {
			defer runs.Done()
			_ = w.Run(ctx, cfg, func(_ context.Context, m string) error {
				mu.Lock()
				defer mu.Unlock()
				if _, again := woken[m]; again {
					t.Errorf("%s woken twice", m)
				}
				woken[m] = time.Now()
				return nil
			})
		}()
	}
	time.Sleep(500 * time.Millisecond) // every waker has subscribed and looked
	check(t)

	slots := map[string]time.Time{}
	for i, left := 0, map[int][2]bool{0: {}, 1: {}, 2: {}}; len(left) > 0; i++ {
		m := fmt.Sprint("late-", i)
		shard := shardOf(m, 3)
		done, ok := left[shard]
		if !ok {
			continue
		}
		slot := time.Now().Add(time.Second)
		if !done[0] {
			err, done[0] = ledger.Add(ctx, m, slot), true
		} else {
			// As a process of the version before adds: a ZADD and a plain
			// PUBLISH of the time on the channel named like the key.
			key := ledger.keys[shard]
			err, done[1] = clients[0].ZAdd(ctx, key, redis.Z{Score: float64(slot.UnixMicro()), Member: m}).Err(), true
			if err == nil {
				err = clients[0].Publish(ctx, key, fmt.Sprint(slot.UnixMicro())).Err()
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		slots[m] = slot
		if left[shard] = done; done[0] && done[1] {
			delete(left, shard)
		}
	}
	time.Sleep(2 * time.Second)
	cancel()
	runs.Wait()
	mu.Lock()
	defer mu.Unlock()
	for m, slot := range slots {
		due := slot.Add(-DefaultLead)
		if at, ok := woken[m]; !ok || at.Sub(due) > time.Second {
			t.Errorf("%s (shard %d) woken %v after its slot less the lead (woken: %v), want within a second", m, shardOf(m, 3), at.Sub(due), ok)
		}
	}
}
