package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
)

// The client-side hot path, against a real redis-server (miniredis would
// run in this process and count its own allocations as ours): allocations
// per Allow and per Wait, and round trips per call.
//
//	go test -run '^$' -bench . -benchmem
//
// BENCH_REDIS_ADDR names a server to use; otherwise one is started.

var (
	benchOnce sync.Once
	benchAddr string
	benchSrv  *redisServer
	benchErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	benchSrv.Stop()
	os.Exit(code)
}

func benchClient(b *testing.B) (*redis.Client, *roundTrips) {
	benchOnce.Do(func() {
		if benchAddr = os.Getenv("BENCH_REDIS_ADDR"); benchAddr != "" {
			return
		}
		benchSrv, benchErr = startRedis(func(string, ...any) {})
		if benchErr == nil {
			benchAddr = benchSrv.Addr
		}
	})
	if benchErr != nil {
		b.Skip("no redis-server:", benchErr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: benchAddr})
	b.Cleanup(func() { rdb.Close() })
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		b.Fatal(err)
	}
	rt := &roundTrips{}
	rdb.AddHook(rt)
	return rdb, rt
}

func benchName(name string) string {
	out := []byte(name)
	for i, c := range out {
		if c == '/' {
			out[i] = '_'
		}
	}
	return string(out)
}

func BenchmarkAllow(b *testing.B) {
	for _, im := range slices.Concat(impls, unbatchedImpls) {
		if !im.Redis {
			continue
		}
		b.Run(benchName(im.Name), func(b *testing.B) {
			rdb, rt := benchClient(b)
			w, err := im.New(rdb, hugeRate, hugeRate)
			if err != nil {
				b.Fatal(err)
			}
			al, ok := w.(Allower)
			if !ok {
				b.Skip("no Allow") // a queue: mennanov's leaky bucket
			}
			ctx := context.Background()
			key := fmt.Sprintf("hot-allow-%s-%d", benchName(im.Name), b.N)
			al.Allow(ctx, key) // load the script
			rt.n.Store(0)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := al.Allow(ctx, key); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(rt.n.Load())/float64(b.N), "roundtrips/op")
		})
	}
}

func BenchmarkWait(b *testing.B) {
	for _, im := range impls {
		b.Run(benchName(im.Name), func(b *testing.B) {
			var rdb *redis.Client
			var rt *roundTrips
			if im.Redis {
				rdb, rt = benchClient(b)
			}
			w, err := im.New(rdb, hugeRate, hugeRate)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			key := fmt.Sprintf("hot-wait-%s-%d", benchName(im.Name), b.N)
			w.Wait(ctx, key)
			if rt != nil {
				rt.n.Store(0)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := w.Wait(ctx, key); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if rt != nil {
				b.ReportMetric(float64(rt.n.Load())/float64(b.N), "roundtrips/op")
			}
		})
	}
}
