package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// simCluster is a throwaway 3-master Redis Cluster on loopback, started
// as scripts/test.sh starts the project's: redis-server processes with
// cluster mode on, joined by redis-cli --cluster create, no replicas, no
// persistence. Stop ends every server it started.
type simCluster struct {
	Addrs   []string
	Version string
	dir     string
	procs   []*exec.Cmd
	done    []chan struct{}
}

// startSimCluster starts masters redis-servers on free ports (each with its
// cluster bus port, +10000, free too) and waits until the cluster is ok.
func startSimCluster(ctx context.Context, masters int, logf func(string, ...any)) (*simCluster, error) {
	bin, err := findRedisServer(logf)
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath("redis-cli"); err != nil {
		return nil, errors.New("bench: fleet: redis-cli not found on PATH; install redis-tools")
	}
	dir, err := os.MkdirTemp("", "jobthrottle-fleet-")
	if err != nil {
		return nil, err
	}
	c := &simCluster{dir: dir}
	port := 27100
	for len(c.Addrs) < masters {
		if port, err = nextClusterPort(port); err != nil {
			c.Stop()
			return nil, err
		}
		if err := c.startNode(bin, port); err != nil {
			c.Stop()
			return nil, err
		}
		port++
	}
	if err := c.create(ctx); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// nextClusterPort returns the first port from p on where nothing listens
// on it nor on its cluster bus port.
func nextClusterPort(p int) (int, error) {
	for ; p < 30000; p++ {
		if portFree(p) && portFree(p+10000) {
			return p, nil
		}
	}
	return 0, errors.New("bench: fleet: no free port pair for a cluster node in 27100-29999")
}

func portFree(p int) bool {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

func (c *simCluster) startNode(bin string, port int) error {
	p := strconv.Itoa(port)
	cmd := exec.Command(bin, "--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", c.dir, "--logfile", filepath.Join(c.dir, "redis-"+p+".log"), "--daemonize", "no",
		"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(c.dir, "nodes-"+p+".conf"),
		"--cluster-node-timeout", "5000", "--maxclients", "15000")
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("bench: fleet: start redis-server: %w", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	c.procs, c.done = append(c.procs, cmd), append(c.done, done)
	addr := "127.0.0.1:" + p
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		select {
		case <-done:
			log, _ := os.ReadFile(filepath.Join(c.dir, "redis-"+p+".log"))
			return fmt.Errorf("bench: fleet: redis-server on %s exited at start:\n%s", addr, tail(string(log), 2000))
		default:
		}
		info, err := rdb.Info(context.Background(), "server").Result()
		if err == nil && parseInfo(info)["process_id"] == strconv.Itoa(cmd.Process.Pid) {
			c.Addrs, c.Version = append(c.Addrs, addr), parseInfo(info)["redis_version"]
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: fleet: redis-server on %s did not answer within 10 s", addr)
		}
	}
}

// create joins the nodes into one cluster, the slots split evenly, and
// waits until every node says cluster_state:ok.
func (c *simCluster) create(ctx context.Context) error {
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("bench: fleet: redis-cli --cluster create: %v\n%s", err, tail(string(out), 2000))
	}
	for _, addr := range c.Addrs {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		err := waitClusterOK(ctx, rdb)
		rdb.Close()
		if err != nil {
			return fmt.Errorf("bench: fleet: %s: %w", addr, err)
		}
	}
	return nil
}

func waitClusterOK(ctx context.Context, rdb *redis.Client) error {
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		info, err := rdb.ClusterInfo(ctx).Result()
		if err == nil && strings.Contains(info, "cluster_state:ok") {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("cluster_state not ok within 30 s: %v", cmpErr(err, ctx.Err()))
		}
	}
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// Stop shuts every node down (SIGTERM, then SIGKILL after 5 s) and removes
// their files.
func (c *simCluster) Stop() {
	if c == nil {
		return
	}
	for _, p := range c.procs {
		_ = p.Process.Signal(os.Interrupt)
	}
	for i, p := range c.procs {
		select {
		case <-c.done[i]:
		case <-time.After(5 * time.Second):
			_ = p.Process.Kill()
			<-c.done[i]
		}
	}
	os.RemoveAll(c.dir)
}

// nodeOf returns the address of the master that holds key's slot.
func nodeOf(ctx context.Context, rdb *redis.ClusterClient, key string) (string, error) {
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return "", err
	}
	slots, err := rdb.ClusterSlots(ctx).Result()
	if err != nil {
		return "", err
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr, nil
		}
	}
	return "", fmt.Errorf("bench: fleet: no master holds slot %d", slot)
}
