// Package redistest gives tests the Redis servers they run against: a
// miniredis for every test, the real Redis and Redis Cluster that
// scripts/test.sh starts, and throwaway redis-server processes (plain, TLS or
// clustered) for tests that must restart, kill or misconfigure a server.
//
// A test that should pass on every backend loops over [Backends]:
//
//	for _, b := range redistest.Backends(t) {
//		t.Run(b.Name, func(t *testing.T) {
//			prefix := redistest.Prefix(t)
//			// use b.Client with keys under prefix; b.Mini is nil on real servers
//		})
//	}
//
// Outside CI, backends whose environment variable is unset are left out and
// real servers that cannot be found are skipped; in CI (CI set to anything)
// both are test failures, so a misconfigured pipeline cannot pass by testing
// nothing. Run bash scripts/test.sh to get every backend.
//
// Imports: go-redis and miniredis; for tests only, it must not import
// throttle or anything above it.
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Environment variables read by this package. scripts/test.sh sets all three.
const (
	// EnvRedisURL names a standalone Redis to test against, as a URL
	// accepted by redis.ParseURL, e.g. "redis://127.0.0.1:16379/0".
	EnvRedisURL = "JOBTHROTTLE_REDIS_URL"
	// EnvRedisCluster names a Redis Cluster to test against, as
	// comma-separated host:port seed addresses.
	EnvRedisCluster = "JOBTHROTTLE_REDIS_CLUSTER"
	// EnvRedisServerBin is the path of the redis-server binary that [Server],
	// [TLSServer] and [Cluster] start. If unset, redis-server is looked up
	// in PATH.
	EnvRedisServerBin = "JOBTHROTTLE_REDIS_SERVER_BIN"
)

// pingTimeout bounds the check that a configured real backend answers.
const pingTimeout = 5 * time.Second

// Backend is one Redis a test suite runs against.
type Backend struct {
	// Name is "miniredis", "redis" or "cluster"; use it as the t.Run name.
	Name string
	// Client talks to the backend. It is closed when the test ends.
	Client redis.UniversalClient
	// Mini is the in-process server behind Client for the "miniredis"
	// backend, for SetTime, FastForward and friends; nil for real servers.
	Mini *miniredis.Miniredis
}

// Backends returns the Redis backends the current environment provides:
// always a fresh miniredis ("miniredis"), plus the standalone Redis named by
// [EnvRedisURL] ("redis") and the Redis Cluster named by [EnvRedisCluster]
// ("cluster") when those are set.
//
// Real backends are shared by every test in the run and are not flushed:
// keep each test's keys under its own [Prefix]. A real backend that is
// configured but does not answer PING fails the test. An unset variable fails
// the test when CI is set, and otherwise leaves that backend out with a log
// line. Every client is closed by t.Cleanup.
func Backends(t testing.TB) []Backend {
	t.Helper()
	mini := miniredis.RunT(t)
	miniClient := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { _ = miniClient.Close() })
	backends := []Backend{{Name: "miniredis", Client: miniClient, Mini: mini}}

	if url, ok := lookupEnv(t, EnvRedisURL); ok {
		opts, err := redis.ParseURL(url)
		if err != nil {
			t.Fatalf("redistest: %s=%q: %v", EnvRedisURL, url, err)
		}
		c := redis.NewClient(opts)
		t.Cleanup(func() { _ = c.Close() })
		mustPing(t, c, EnvRedisURL, url)
		backends = append(backends, Backend{Name: "redis", Client: c})
	}

	if seeds, ok := lookupEnv(t, EnvRedisCluster); ok {
		var addrs []string
		for a := range strings.SplitSeq(seeds, ",") {
			if a = strings.TrimSpace(a); a != "" {
				addrs = append(addrs, a)
			}
		}
		if len(addrs) == 0 {
			t.Fatalf("redistest: %s=%q names no address; want host:port[,host:port...]", EnvRedisCluster, seeds)
		}
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
		t.Cleanup(func() { _ = c.Close() })
		mustPing(t, c, EnvRedisCluster, seeds)
		backends = append(backends, Backend{Name: "cluster", Client: c})
	}
	return backends
}

// lookupEnv returns the value of the environment variable name, failing the
// test in CI if it is unset and logging the omission otherwise.
func lookupEnv(t testing.TB, name string) (string, bool) {
	t.Helper()
	v := os.Getenv(name)
	if v != "" {
		return v, true
	}
	if inCI() {
		t.Fatalf("redistest: %s must be set in CI; run bash scripts/test.sh", name)
	}
	t.Logf("redistest: %s is not set, so this backend is left out; bash scripts/test.sh sets it", name)
	return "", false
}

func mustPing(t testing.TB, c redis.UniversalClient, env, value string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), pingTimeout)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("redistest: %s=%q does not answer PING: %v (is the server running? bash scripts/test.sh starts one)", env, value, err)
	}
}

// inCI reports whether the tests run in CI, where missing servers are failures
// rather than skips.
func inCI() bool { return os.Getenv("CI") != "" }

// Prefix returns a key prefix unique to this test and this call, of the form
// "jt-test:<test name>:<random hex>:". The test name is reduced to letters,
// digits and "-_./" (other characters become "_") so that the prefix never
// contains a cluster hash tag: the prefix contains no '{' or '}'.
func Prefix(t testing.TB) string {
	t.Helper()
	name := []byte(t.Name())
	if len(name) > 80 {
		name = name[len(name)-80:]
	}
	for i, c := range name {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9',
			c == '-', c == '_', c == '.', c == '/':
		default:
			name[i] = '_'
		}
	}
	var r [6]byte
	_, _ = rand.Read(r[:]) // crypto/rand.Read never fails (Go 1.24+)
	return "jt-test:" + string(name) + ":" + hex.EncodeToString(r[:]) + ":"
}
