package redistest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// clusterCreateTimeout bounds redis-cli --cluster create.
	clusterCreateTimeout = time.Minute
	// clusterReadyTimeout bounds the wait for every node to agree the
	// cluster is whole and every replica to be in sync.
	clusterReadyTimeout = 30 * time.Second
)

// ClusterProcs is a Redis Cluster of local redis-server processes started by
// [Cluster].
type ClusterProcs struct {
	// Nodes are the cluster's processes in the order they were given to
	// redis-cli --cluster create, which assigns the first ones the masters'
	// roles. A node that is stopped and restarted rejoins with its slots.
	Nodes []*Proc
}

// Addrs returns every node's "127.0.0.1:port".
func (c *ClusterProcs) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// Client returns a cluster client seeded with every node, closed when the
// test ends.
func (c *ClusterProcs) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// Cluster starts a Redis Cluster of masters masters (at least 3) with
// replicasPerMaster replicas each, all on free ports of 127.0.0.1 (each with
// a free cluster bus port of its own, --cluster-node-timeout 2000), joined
// with redis-cli --cluster create. It returns once every node reports
// cluster_state:ok and knows every other node, and every replica is in sync
// with its master. opts apply to every node. The nodes stop when the test
// ends.
//
// redis-cli is looked up next to the redis-server binary, then in PATH; like
// redis-server, a missing one skips the test, or fails it when CI is set.
func Cluster(t testing.TB, masters, replicasPerMaster int, opts ...Option) *ClusterProcs {
	t.Helper()
	if masters < 3 {
		t.Fatalf("redistest: a Redis Cluster needs at least 3 masters, got %d", masters)
	}
	if replicasPerMaster < 0 {
		t.Fatalf("redistest: replicasPerMaster must not be negative, got %d", replicasPerMaster)
	}
	cli := cliBin(t)
	cfg := serverConfig{cluster: true}
	for _, o := range opts {
		o(&cfg)
	}
	c := &ClusterProcs{}
	for range masters * (1 + replicasPerMaster) {
		c.Nodes = append(c.Nodes, startProc(t, cfg))
	}

	ctx, cancel := context.WithTimeout(context.Background(), clusterCreateTimeout)
	defer cancel()
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicasPerMaster), "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redistest: %s %s: %v\n%s", cli, strings.Join(args, " "), err, out)
	}

	if err := c.waitReady(masters * replicasPerMaster); err != nil {
		t.Fatalf("redistest: cluster %v not ready after %v: %v", c.Addrs(), clusterReadyTimeout, err)
	}
	return c
}

// cliBin returns the redis-cli binary to run.
func cliBin(t testing.TB) string {
	t.Helper()
	if cli := filepath.Join(filepath.Dir(serverBin(t)), "redis-cli"); fileExists(cli) {
		return cli
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		missing(t, "redis-cli not found next to redis-server or in PATH; install redis-tools or run bash scripts/test.sh")
	}
	return cli
}

func fileExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && !st.IsDir()
}

// waitReady polls every node until the cluster is whole, returning the last
// reason it was not when clusterReadyTimeout passes.
func (c *ClusterProcs) waitReady(replicas int) error {
	clients := make([]*redis.Client, len(c.Nodes))
	for i, n := range c.Nodes {
		clients[i] = redis.NewClient(&redis.Options{Addr: n.Addr(), MaxRetries: -1})
		defer clients[i].Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterReadyTimeout)
	defer cancel()
	for {
		err := c.ready(ctx, clients, replicas)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ready returns nil if every node sees the cluster whole and every replica is
// in sync, or else the first reason it is not.
func (c *ClusterProcs) ready(ctx context.Context, clients []*redis.Client, replicas int) error {
	for _, cl := range clients {
		if err := c.nodeReady(ctx, cl, replicas); err != nil {
			return err
		}
	}

	// CLUSTER SLOTS, which cluster clients route by, lists a replica only
	// once its replication offset, gossiped, is above zero. With no writes
	// that waits for the master's next replication PING (every 10 s); a
	// FLUSHALL of the still empty masters moves the offsets now.
	if replicas > 0 {
		for _, cl := range clients {
			if repl, err := cl.Info(ctx, "replication").Result(); err == nil && hasLine(repl, "role:master") {
				_ = cl.FlushAll(ctx).Err()
			}
		}
	}
	for _, cl := range clients {
		addr := cl.Options().Addr
		slots, err := cl.ClusterSlots(ctx).Result()
		if err != nil {
			return fmt.Errorf("%s: CLUSTER SLOTS: %v", addr, err)
		}
		listed := 0
		for _, s := range slots {
			listed += len(s.Nodes) - 1
		}
		if listed != replicas {
			return fmt.Errorf("%s: CLUSTER SLOTS lists %d replicas, want %d", addr, listed, replicas)
		}
	}
	return nil
}

// nodeReady returns nil if the node cl sees the cluster whole, with
// replicas replicas and no node failing, and is in sync if it is a
// replica; or else the first reason it is not.
func (c *ClusterProcs) nodeReady(ctx context.Context, cl *redis.Client, replicas int) error {
	addr := cl.Options().Addr
	info, err := cl.ClusterInfo(ctx).Result()
	if err != nil {
		return fmt.Errorf("%s: CLUSTER INFO: %v", addr, err)
	}
	for _, w := range []string{"cluster_state:ok", "cluster_slots_ok:16384", "cluster_known_nodes:" + strconv.Itoa(len(c.Nodes))} {
		if !hasLine(info, w) {
			return fmt.Errorf("%s: CLUSTER INFO lacks %s", addr, w)
		}
	}
	nodes, err := cl.ClusterNodes(ctx).Result()
	if err != nil {
		return fmt.Errorf("%s: CLUSTER NODES: %v", addr, err)
	}
	if got := strings.Count(nodes, "slave"); got != replicas {
		return fmt.Errorf("%s: sees %d replicas, want %d", addr, got, replicas)
	}
	for _, bad := range []string{"fail", "handshake", "noaddr", "disconnected"} {
		if strings.Contains(nodes, bad) {
			return fmt.Errorf("%s: a node is %s:\n%s", addr, bad, nodes)
		}
	}
	repl, err := cl.Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Errorf("%s: INFO replication: %v", addr, err)
	}
	if hasLine(repl, "role:slave") &&
		(!hasLine(repl, "master_link_status:up") || !hasLine(repl, "master_sync_in_progress:0")) {
		return fmt.Errorf("%s: replica not in sync:\n%s", addr, repl)
	}
	return nil
}

// hasLine reports whether the INFO-style text has the line want.
func hasLine(text, want string) bool {
	for line := range strings.Lines(text) {
		if strings.TrimRight(line, "\r\n") == want {
			return true
		}
	}
	return false
}
