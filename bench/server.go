package main

import (
	"bufio"
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

// redisServer is a throwaway redis-server on a free loopback port, with no
// persistence, started for one benchmark run.
type redisServer struct {
	Addr    string
	cmd     *exec.Cmd
	dir     string
	done    chan struct{}
	version string
}

// findRedisServer returns the redis-server binary, installing Debian's
// package with apt-get if none is on PATH and we are root.
func findRedisServer(logf func(string, ...any)) (string, error) {
	if p, err := exec.LookPath("redis-server"); err == nil {
		return p, nil
	}
	if os.Geteuid() != 0 {
		return "", errors.New("bench: redis-server not found on PATH; install it (apt-get install redis-server)")
	}
	logf("redis-server not found; installing it with apt-get")
	for _, args := range [][]string{{"update"}, {"install", "-y", "redis-server", "redis-tools"}} {
		c := exec.Command("apt-get", args...)
		c.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := c.CombinedOutput(); err != nil {
			return "", fmt.Errorf("bench: apt-get %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	return exec.LookPath("redis-server")
}

// freePort asks the kernel for a free TCP port on 127.0.0.1.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startRedis starts redis-server and returns once it answers PING.
func startRedis(logf func(string, ...any)) (*redisServer, error) {
	return startRedisUnder(logf, nil, 10*time.Second)
}

// startRedisUnder starts redis-server behind the command wrap returns for
// the server's own directory (nil: none), such as valgrind, and returns
// once it answers PING, allowing ready for that. A port another process
// took between freePort and the server's bind costs another attempt.
func startRedisUnder(logf func(string, ...any), wrap func(dir string) []string, ready time.Duration) (*redisServer, error) {
	bin, err := findRedisServer(logf)
	if err != nil {
		return nil, err
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		s, err := tryStartRedis(bin, wrap, ready)
		if err == nil {
			return s, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

func tryStartRedis(bin string, wrap func(dir string) []string, ready time.Duration) (*redisServer, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "jobthrottle-bench-redis-")
	if err != nil {
		return nil, err
	}
	argv := []string{bin,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log"),
		"--daemonize", "no", "--protected-mode", "yes",
	}
	if wrap != nil {
		argv = append(wrap(dir), argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	// The server logs to its logfile; stderr is a wrapper's (valgrind's).
	stderr, err := os.Create(filepath.Join(dir, "stderr.log"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer stderr.Close()
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("bench: start %s: %w", argv[0], err)
	}
	s := &redisServer{Addr: fmt.Sprintf("127.0.0.1:%d", port), cmd: cmd, dir: dir, done: make(chan struct{})}
	go func() { cmd.Wait(); close(s.done) }()

	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer rdb.Close()
	deadline := time.Now().Add(ready)
	for {
		select {
		case <-s.done:
			log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
			errLog, _ := os.ReadFile(filepath.Join(dir, "stderr.log"))
			os.RemoveAll(dir)
			return nil, fmt.Errorf("bench: redis-server exited at start:\n%s%s", tail(string(errLog), 1000), tail(string(log), 2000))
		default:
		}
		// Until the port accepts, go-redis would log every failed dial: a
		// server under valgrind takes a second or more to listen.
		err := errNotListening
		if c, derr := net.DialTimeout("tcp", s.Addr, 200*time.Millisecond); derr == nil {
			c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			err = rdb.Ping(ctx).Err()
			cancel()
		}
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, fmt.Errorf("bench: redis-server did not answer PING: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	info, err := rdb.Info(context.Background(), "server").Result()
	if err == nil {
		s.version = parseInfo(info)["redis_version"]
	}
	return s, nil
}

var errNotListening = errors.New("not listening yet")

// Stop shuts the server down (SIGTERM, then SIGKILL) and removes its files.
func (s *redisServer) Stop() {
	if s == nil || s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(os.Interrupt)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	os.RemoveAll(s.dir)
}

// parseInfo reads INFO output into a map of field to value.
func parseInfo(s string) map[string]string {
	m := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = v
		}
	}
	return m
}

// serverStats is the part of INFO a scenario compares before and after.
type serverStats struct {
	CPU    float64          // used_cpu_user + used_cpu_sys, seconds
	Calls  map[string]int64 // INFO commandstats calls, by command
	Usec   map[string]int64 // INFO commandstats usec, by command
	Memory int64            // used_memory, bytes
	// ClientMemory is mem_clients_normal: the connections' buffers, part
	// of used_memory.
	ClientMemory int64
	Clients      int64 // connected_clients
	Keys         int64
	Received     int64 // total_commands_processed
}

func readStats(ctx context.Context, rdb *redis.Client) (serverStats, error) {
	s, err := rdb.Info(ctx, "cpu", "commandstats", "memory", "clients", "stats").Result()
	if err != nil {
		return serverStats{}, err
	}
	m := parseInfo(s)
	st := serverStats{Calls: map[string]int64{}, Usec: map[string]int64{}}
	u, _ := strconv.ParseFloat(m["used_cpu_user"], 64)
	y, _ := strconv.ParseFloat(m["used_cpu_sys"], 64)
	st.CPU = u + y
	st.Memory, _ = strconv.ParseInt(m["used_memory"], 10, 64)
	st.ClientMemory, _ = strconv.ParseInt(m["mem_clients_normal"], 10, 64)
	st.Clients, _ = strconv.ParseInt(m["connected_clients"], 10, 64)
	st.Received, _ = strconv.ParseInt(m["total_commands_processed"], 10, 64)
	for k, v := range m {
		name, ok := strings.CutPrefix(k, "cmdstat_")
		if !ok {
			continue
		}
		for _, f := range strings.Split(v, ",") {
			if c, ok := strings.CutPrefix(f, "calls="); ok {
				st.Calls[name], _ = strconv.ParseInt(c, 10, 64)
			}
			if u, ok := strings.CutPrefix(f, "usec="); ok {
				st.Usec[name], _ = strconv.ParseInt(u, 10, 64)
			}
		}
	}
	return st, nil
}

// adminCommand reports whether a command is the harness's or connection
// setup's own (INFO, PING, HELLO, CLIENT …), not the limiter's work.
func adminCommand(name string) bool {
	base, _, _ := strings.Cut(name, "|")
	switch base {
	case "info", "ping", "hello", "client", "config", "select", "command", "flushall", "flushdb",
		"memory", "dbsize", "script", "debug", "scan", "randomkey":
		return true
	}
	return false
}

// callDelta is the limiter's commands between two INFO readings: the total
// (commands run inside scripts included, as Redis counts them) and
// EVALSHA + EVAL alone.
func callDelta(a, b serverStats) (total, scripts int64) {
	for name, n := range b.Calls {
		if adminCommand(name) {
			continue
		}
		d := n - a.Calls[name]
		total += d
		if name == "evalsha" || name == "eval" || name == "evalsha_ro" || name == "eval_ro" {
			scripts += d
		}
	}
	return total, scripts
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[len(s)-n:]
}
