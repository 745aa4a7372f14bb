package reliability

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestClusterFailover runs 20 goroutines reserving and waiting for slots
// of one busy subject (GCRA 100/s, burst 10) on a 3-master, 3-replica Redis
// Cluster, and 1.5s into the 5s run fails the subject's master over to its
// replica: CLUSTER FAILOVER (the replica first catches up with the master),
// CLUSTER FAILOVER FORCE (it does not; on loopback it is rarely behind), and
// FORCE 100ms after the master dropped the replication link (the replica is
// promoted without the master's last 100ms of writes, which are lost: the
// case async replication allows). Waits must resume on the new master
// (the ClusterClient follows MOVED), every error in the switch must match
// ErrRedis, and the limit may be exceeded by at most one window's worth
// (100 permits in a second beyond 100 + burst); the test reports by how
// much it was, how long no slot was granted, and how many Waits failed.
func TestClusterFailover(t *testing.T) {
	t.Parallel() // each mode on a cluster of its own, mostly waiting
	for _, mode := range []string{"graceful", "force", "force-lagging"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			cl := redistest.Cluster(t, 3, 1)
			// The test's clients log in as "jt" on every node, so that the
			// lagging case can turn the default user (which replicas use)
			// off on the master.
			for _, n := range cl.Nodes {
				if err := n.Client(t).Do(context.Background(), "ACL", "SETUSER", "jt", "on", ">pw", "~*", "&*", "+@all").Err(); err != nil {
					t.Fatal(err)
				}
			}
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), Username: "jt", Password: "pw", DialerRetries: 1, MaxRetries: 3})
			t.Cleanup(func() { _ = cc.Close() })
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			const rate, burst = 100, 10
			lim, err := throttle.New(cc, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(burst)})
			if err != nil {
				t.Fatal(err)
			}
			key := prefix + "{busy}:r"
			master, err := cc.MasterForKey(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			replica := replicaOf(t, master)

			var mu sync.Mutex
			var slots []time.Time
			var failures []string
			start := time.Now()
			end := start.Add(5 * time.Second)
			var wg sync.WaitGroup
			for range 20 {
				wg.Go(func() {
					for time.Now().Before(end) {
						// Wait, with the slot recorded: Reserve, then sleep.
						rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
						r, err := lim.ReserveN(rctx, "busy", 1)
						cancel()
						if err != nil {
							mu.Lock()
							failures = append(failures, fmt.Sprintf("%v: %v", time.Since(start).Round(time.Millisecond), err))
							mu.Unlock()
							if !errors.Is(err, throttle.ErrRedis) {
								t.Errorf("Reserve during failover = %v; want nil or ErrRedis", err)
							}
							time.Sleep(10 * time.Millisecond)
							continue
						}
						mu.Lock()
						slots = append(slots, time.Now().Add(r.Delay()))
						mu.Unlock()
						time.Sleep(time.Until(time.Now().Add(r.Delay())))
					}
				})
			}
			time.Sleep(1500 * time.Millisecond)
			args := []any{"CLUSTER", "FAILOVER"}
			if mode != "graceful" {
				args = append(args, "FORCE")
			}
			var lost int64
			if mode == "force-lagging" {
				// Cut the replication link and keep it cut: the replica
				// logs in as the default user, which the master now
				// refuses. The master goes on accepting writes for 200ms
				// that the replica never sees.
				if err := master.Do(ctx, "ACL", "SETUSER", "default", "off").Err(); err != nil {
					t.Fatal(err)
				}
				if err := master.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
					t.Fatal(err)
				}
				time.Sleep(200 * time.Millisecond)
				lost = replOffset(t, master, "master_repl_offset") - replOffset(t, replica, "slave_repl_offset")
				if lost <= 0 {
					t.Fatalf("the replica is not behind the master (%d bytes); the test could not cut replication", lost)
				}
			}
			switchStart := time.Now()
			if err := replica.Do(ctx, args...).Err(); err != nil {
				t.Fatalf("%v on %s: %v", args, replica.Options().Addr, err)
			}
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				info, _ := replica.Info(ctx, "replication").Result()
				if strings.Contains(info, "role:master") {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s did not become master within 20s", replica.Options().Addr)
				}
			}
			promoted := time.Since(switchStart)
			wg.Wait()

			if now, err := cc.MasterForKey(ctx, key); err != nil || now.Options().Addr != replica.Options().Addr {
				t.Errorf("after the failover the busy slot's master is %v (%v); want the old replica %s", now, err, replica.Options().Addr)
			}
			slices.SortFunc(slots, func(a, b time.Time) int { return a.Compare(b) })
			worst, worstAt := 0, time.Duration(0)
			for i := range slots {
				j, _ := slices.BinarySearchFunc(slots, slots[i].Add(time.Second), func(a, b time.Time) int { return a.Compare(b) })
				if j-i > worst {
					worst, worstAt = j-i, slots[i].Sub(start)
				}
			}
			gap, gapAt := time.Duration(0), time.Duration(0)
			for i := 1; i < len(slots); i++ {
				if d := slots[i].Sub(slots[i-1]); d > gap {
					gap, gapAt = d, slots[i-1].Sub(start)
				}
			}
			var after int
			for _, s := range slots {
				if s.After(switchStart.Add(promoted)) {
					after++
				}
			}
			allowed := rate + burst + 1 // +1: slots are local times, to about a millisecond
			overshoot := max(0, worst-allowed)
			if lost > 0 {
				t.Logf("the replica was %d bytes of replication stream behind when promoted", lost)
			}
			t.Logf("%s failover: replica promoted in %v; %d slots granted (%d after the switch), %d Reserve errors; most slots in any 1s: %d at %v (limit %d/s + burst %d): overshoot %d; longest gap between slots %v at %v",
				mode, promoted.Round(time.Millisecond), len(slots), after, len(failures), worst, worstAt.Round(time.Millisecond), rate, burst, overshoot, gap.Round(time.Millisecond), gapAt.Round(time.Millisecond))
			for _, f := range failures[:min(len(failures), 5)] {
				t.Logf("  error: %s", f)
			}
			if after < rate {
				t.Errorf("only %d slots after the switch; want Waits to resume on the new master", after)
			}
			if overshoot > rate {
				t.Errorf("%d slots in one second: the limit was exceeded by %d, more than one window's worth (%d)", worst, overshoot, rate)
			}
		})
	}
}

// replicaOf returns a client for a replica of master, found in master's
// CLUSTER NODES, closed when the test ends.
func replicaOf(t *testing.T, master *redis.Client) *redis.Client {
	t.Helper()
	ctx := context.Background()
	id, err := master.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatal(err)
	}
	nodes, err := master.ClusterNodes(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(nodes) {
		f := strings.Fields(line)
		// <id> <ip:port@cport> <flags> <master id> ...
		if len(f) > 3 && f[3] == id && strings.Contains(f[2], "slave") {
			addr, _, _ := strings.Cut(f[1], "@")
			c := redis.NewClient(&redis.Options{Addr: addr})
			t.Cleanup(func() { _ = c.Close() })
			return c
		}
	}
	t.Fatalf("no replica of %s (%s) in CLUSTER NODES:\n%s", master.Options().Addr, id, nodes)
	return nil
}

// replOffset returns the named offset from c's INFO replication.
func replOffset(t *testing.T, c *redis.Client, field string) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "replication").Result()
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			var n int64
			if _, err := fmt.Sscan(v, &n); err == nil {
				return n
			}
		}
	}
	t.Fatalf("INFO replication of %s has no %s:\n%s", c.Options().Addr, field, info)
	return 0
}
