package admission

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// clusterClients returns n clients of the 3-master Redis Cluster that
// scripts/test.sh starts (redistest.EnvRedisCluster), each its own
// process's, closed when the test ends.
func clusterClients(tb testing.TB, n int) []*redis.ClusterClient {
	tb.Helper()
	seeds := os.Getenv(redistest.EnvRedisCluster)
	if seeds == "" {
		// As redistest.Backends does: required in CI, left out with a
		// reason elsewhere (go test without scripts/test.sh).
		msg := redistest.EnvRedisCluster + " is not set: run bash scripts/test.sh, which starts a 3-master cluster"
		if os.Getenv("CI") != "" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	out := make([]*redis.ClusterClient, n)
	for i := range out {
		out[i] = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(seeds, ",")})
		tb.Cleanup(func() { _ = out[i].Close() })
	}
	return out
}

// On a real 3-master Redis Cluster, the three shards' keys are on three
// masters; 3,000 wake-ups added one call each by 30 goroutines land in
// every shard, about a third each; three wakers, each with its own client,
// wake every one exactly once, none lost, and leave the shards empty. Then,
// their ledger empty and their idle looks a minute apart, a wake-up added
// to each shard is woken within seconds of its slot, not at the next idle
// look: the one subscription of each waker hears the adds of every shard,
// whichever master holds it.
func TestWakeupsCluster(t *testing.T) {
	ctx := context.Background()
	clients := clusterClients(t, 4)
	base := redistest.Prefix(t) + "{wakeups}"
	ledger, err := NewShardedWakeups(clients[0], base, 3)
	if err != nil {
		t.Fatal(err)
	}
	masters := map[string]bool{}
	for _, k := range ledger.Keys() {
		m, err := clients[0].MasterForKey(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		masters[m.Options().Addr] = true
	}
	if len(masters) != 3 {
		t.Errorf("the shards %v are on %d masters, want 3", ledger.Keys(), len(masters))
	}

	const n = 3000
	due := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	for g := range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < n; i += 30 {
				if err := ledger.Add(ctx, fmt.Sprint("job-", i), due.Add(time.Duration(i)*time.Millisecond/2)); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	var held []int64
	for _, k := range ledger.Keys() {
		c, err := clients[0].ZCard(ctx, k).Result()
		if err != nil || c < n/4 || c > n/2 {
			t.Errorf("shard %s holds %d of %d (%v), want about a third", k, c, n, err)
		}
		held = append(held, c)
	}
	t.Logf("shards %v on %d masters hold %v of %d wake-ups", ledger.Keys(), len(masters), held, n)

	var woken sync.Map
	var count atomic.Int64
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var runs sync.WaitGroup
	for _, c := range clients[1:] {
		w, _ := NewShardedWakeups(c, base, 3)
		runs.Add(1)
		go func() {
			defer runs.Done()
			_ = w.Run(rctx, RunOptions{Idle: time.Minute, OnError: func(err error) { t.Error(err) }}, func(_ context.Context, m string) error {
				if _, again := woken.LoadOrStore(m, true); again {
					t.Errorf("%s woken twice", m)
				}
				count.Add(1)
				return nil
			})
		}()
	}
	deadline := time.Now().Add(30 * time.Second)
	for count.Load() < n && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond) // a double wake-up would come now
	if got := count.Load(); got != n {
		t.Errorf("%d wake-ups, want %d, each once", got, n)
	}
	if left, err := ledger.Len(ctx); err != nil || left != 0 {
		t.Errorf("%d left in the ledger (%v), want 0", left, err)
	}

	late := map[int]string{} // one member per shard
	for i := 0; len(late) < 3; i++ {
		if m := fmt.Sprint("late-", i); late[shardOf(m, 3)] == "" {
			late[shardOf(m, 3)] = m
		}
	}
	slot := time.Now().Add(time.Second)
	for _, m := range late {
		if err := ledger.Add(ctx, m, slot); err != nil {
			t.Fatal(err)
		}
	}
	for time.Now().Before(slot.Add(5*time.Second)) && count.Load() < n+3 {
		time.Sleep(20 * time.Millisecond)
	}
	woke := time.Now()
	cancel()
	runs.Wait()
	if got := count.Load(); got != n+3 {
		t.Errorf("%d of the 3 wake-ups added to idle wakers woken by %v after their slot, want all (told by their shards' channels)", got-n, woke.Sub(slot))
	}
}

// BenchmarkWakeupsParkCluster adds wake-ups to a ledger of one shard and
// of three on the 3-master Redis Cluster as a fleet parking tasks would,
// each add its own script call, from parallel pipelines (so that the
// client, which a real fleet spreads over many machines, costs little per
// call next to the servers): parks/s is the parking throughput on this
// machine, busiest-share the part of the parks the busiest master took,
// and parks/master-cpu-s the parks per CPU second (INFO cpu, user + sys)
// of the busiest master: the throughput the cluster reaches when its
// masters, not the machine they share with the client, are the limit.
func BenchmarkWakeupsParkCluster(b *testing.B) {
	for _, shards := range []int{1, 3} {
		b.Run(fmt.Sprintf("shards=%d", shards), func(b *testing.B) {
			benchmarkPark(b, shards)
		})
	}
}

func benchmarkPark(b *testing.B, shards int) {
	ctx := context.Background()
	cc := clusterClients(b, 1)[0]
	ledger, err := NewShardedWakeups(cc, fmt.Sprintf("bench%d:{wakeups}", time.Now().UnixNano()), shards)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		for _, k := range ledger.Keys() {
			cc.Del(ctx, k)
		}
	}()
	// Load the script on every master: a pipeline does not fall back to
	// EVAL on NOSCRIPT.
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		return wakeAddScript.Load(ctx, m).Err()
	}); err != nil {
		b.Fatal(err)
	}
	const depth = 64
	at := time.Now().Add(time.Hour).UnixMicro()
	var seq atomic.Int64
	before := masterCPU(b, cc)
	b.SetParallelism(4)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		pipe := cc.Pipeline()
		flush := func() {
			if _, err := pipe.Exec(ctx); err != nil {
				b.Error(err)
			}
		}
		for pb.Next() {
			m := fmt.Sprint("job-", seq.Add(1))
			wakeAddScript.EvalSha(ctx, pipe, []string{ledger.keyOf(m)}, m, at+seq.Load(), ledgerKeepMs)
			if pipe.Len() == depth {
				flush()
			}
		}
		if pipe.Len() > 0 {
			flush()
		}
	})
	b.StopTimer()
	busiestCPU := 0.0
	for addr, cpu := range masterCPU(b, cc) {
		busiestCPU = max(busiestCPU, cpu-before[addr])
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "parks/s")
	b.ReportMetric(float64(b.N)/busiestCPU, "parks/master-cpu-s")
	var busiest int64
	for _, k := range ledger.Keys() {
		busiest = max(busiest, cc.ZCard(ctx, k).Val())
	}
	b.ReportMetric(float64(busiest)/float64(b.N), "busiest-share")
}

// masterCPU returns the CPU seconds (user + sys) each master of cc has
// used, by address.
func masterCPU(tb testing.TB, cc *redis.ClusterClient) map[string]float64 {
	var mu sync.Mutex
	out := map[string]float64{}
	err := cc.ForEachMaster(context.Background(), func(ctx context.Context, m *redis.Client) error {
		info, err := m.Info(ctx, "cpu").Result()
		if err != nil {
			return err
		}
		var cpu float64
		for line := range strings.SplitSeq(info, "\r\n") {
			name, v, _ := strings.Cut(line, ":")
			if name == "used_cpu_user" || name == "used_cpu_sys" {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					return fmt.Errorf("INFO cpu: %q: %w", line, err)
				}
				cpu += f
			}
		}
		mu.Lock()
		defer mu.Unlock()
		out[m.Options().Addr] = cpu
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return out
}
