package redistest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

func TestBackends(t *testing.T) {
	for _, b := range Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := t.Context()
			key := Prefix(t) + "k"
			if err := b.Client.Set(ctx, key, "v", time.Minute).Err(); err != nil {
				t.Fatalf("SET: %v", err)
			}
			if got, err := b.Client.Get(ctx, key).Result(); err != nil || got != "v" {
				t.Fatalf("GET = %q, %v; want \"v\", nil", got, err)
			}
			if (b.Mini != nil) != (b.Name == "miniredis") {
				t.Errorf("Mini = %v for backend %q", b.Mini, b.Name)
			}
		})
	}
}

func TestPrefix(t *testing.T) {
	t.Run("odd {name}: ok", func(t *testing.T) {
		a, b := Prefix(t), Prefix(t)
		if a == b {
			t.Errorf("two calls both gave %q", a)
		}
		for _, p := range []string{a, b} {
			if !strings.HasPrefix(p, "jt-test:TestPrefix/odd__name___ok:") || !strings.HasSuffix(p, ":") {
				t.Errorf("Prefix = %q, want jt-test:TestPrefix/odd__name___ok:<hex>:", p)
			}
			if strings.ContainsAny(p, "{} ") {
				t.Errorf("Prefix = %q contains a brace or space", p)
			}
		}
	})
}

func TestServer(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	p := Server(t, Args("--maxmemory", "12345678"))
	c := p.Client(t)
	if want := "redis://127.0.0.1:" + strconv.Itoa(p.Port()) + "/0"; p.URL() != want {
		t.Errorf("URL() = %q, want %q", p.URL(), want)
	}
	if got, err := c.ConfigGet(ctx, "maxmemory").Result(); err != nil || got["maxmemory"] != "12345678" {
		t.Errorf("CONFIG GET maxmemory = %v, %v; want 12345678 (from Args)", got, err)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}

	port := p.Port()
	p.Restart(t)
	if p.Port() != port {
		t.Errorf("port after Restart = %d, want %d", p.Port(), port)
	}
	if n, err := c.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("EXISTS k after Restart = %d, %v; want 0 (no persistence)", n, err)
	}

	p.Kill()
	if err := pingOnce(ctx, p.Addr(), nil); err == nil {
		t.Fatal("PING after Kill succeeded")
	}
	p.Restart(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Kill and Restart: %v", err)
	}

	p.Stop()
	p.Stop() // stopping twice does nothing
	if err := pingOnce(ctx, p.Addr(), nil); err == nil {
		t.Fatal("PING after Stop succeeded")
	}
}

func TestTLSServer(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	p, files := TLSServer(t)
	for _, f := range []string{files.CAFile, files.CertFile, files.KeyFile} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("TLS file: %v", err)
		}
	}
	if !strings.HasPrefix(p.URL(), "rediss://") {
		t.Errorf("URL() = %q, want rediss://…", p.URL())
	}
	if err := pingOnce(ctx, p.Addr(), files.ClientConfig()); err != nil {
		t.Fatalf("PING with the test CA: %v", err)
	}
	if err := p.Client(t).Ping(ctx).Err(); err != nil {
		t.Fatalf("PING through Proc.Client: %v", err)
	}

	err := pingOnce(ctx, p.Addr(), &tls.Config{RootCAs: OtherCA(t), ServerName: "127.0.0.1"})
	var unknown x509.UnknownAuthorityError
	if !errors.As(err, &unknown) {
		t.Fatalf("PING trusting another CA: err = %v, want x509.UnknownAuthorityError", err)
	}
	if err := pingOnce(ctx, p.Addr(), nil); err == nil {
		t.Fatal("plain-text PING to the TLS port succeeded")
	}
}

func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	c := Cluster(t, 3, 0)
	if len(c.Nodes) != 3 || len(c.Addrs()) != 3 {
		t.Fatalf("%d nodes, %d addrs; want 3 and 3", len(c.Nodes), len(c.Addrs()))
	}
	cc := c.Client(t)
	prefix := Prefix(t)
	var keys []string
	for i := range 30 { // 30 hash tags fall in all three masters' slot ranges
		keys = append(keys, prefix+"{"+strconv.Itoa(i)+"}")
	}
	for _, k := range keys {
		if err := cc.Set(ctx, k, k, time.Minute).Err(); err != nil {
			t.Fatalf("SET %s: %v", k, err)
		}
	}
	for _, k := range keys {
		if got, err := cc.Get(ctx, k).Result(); err != nil || got != k {
			t.Fatalf("GET %s = %q, %v; want %q", k, got, err, k)
		}
	}
	for _, n := range c.Nodes {
		size, err := n.Client(t).DBSize(ctx).Result()
		if err != nil || size == 0 {
			t.Errorf("node %s holds %d keys (%v); want some: keys should spread over every master", n.Addr(), size, err)
		}
	}
}

func TestClusterReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("starts six redis-server processes")
	}
	t.Parallel()
	ctx := t.Context()
	c := Cluster(t, 3, 1)
	var replicas atomic.Int32
	err := c.Client(t).ForEachSlave(ctx, func(ctx context.Context, r *redis.Client) error {
		replicas.Add(1)
		return r.Ping(ctx).Err()
	})
	if got := replicas.Load(); err != nil || got != 3 {
		t.Fatalf("ForEachSlave saw %d replicas (%v), want 3", got, err)
	}
}

// pingOnce sends one PING on a fresh connection, without retries.
func pingOnce(ctx context.Context, addr string, tlsConf *tls.Config) error {
	c := redis.NewClient(&redis.Options{Addr: addr, TLSConfig: tlsConf, MaxRetries: -1, DialTimeout: time.Second})
	defer c.Close()
	return c.Ping(ctx).Err()
}

// A client made by PipeClient never waits for a connection inside a
// bubble, even with more commands at once than go-redis's default pool
// (ten per CPU): waiting would take a timer from go-redis's process-wide
// pool, and a timer shared between a bubble and the rest of the test
// binary crashes it (see BubblePoolSize).
func TestPipeClientNeverWaitsForAConnection(t *testing.T) {
	Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		const commands = 200
		var wg sync.WaitGroup
		for i := range commands {
			wg.Go(func() {
				// Each holds its connection for a second of the bubble's
				// clock, so all 200 need one at once.
				if _, err := rdb.BLPop(context.Background(), time.Second, fmt.Sprint("empty-", i)).Result(); err != redis.Nil {
					t.Errorf("BLPOP on an empty list: %v, want redis.Nil", err)
				}
			})
		}
		wg.Wait()
		if st := rdb.PoolStats(); st.WaitCount != 0 || st.Timeouts != 0 {
			t.Fatalf("pool stats %+v: commands waited for a connection, want none", *st)
		}
	})
}
