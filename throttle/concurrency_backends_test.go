package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestBackendsConcurrency: on every backend (a real server and a real
// cluster too), a policy of a rate rule and a concurrency rule takes its
// places in one script over keys of one slot; a third Wait queues and takes
// the place a Release frees; the places' key has a TTL of a few leases.
func TestBackendsConcurrency(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "rate", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1000)},
				throttle.Rule{Name: "two", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Second}})
			if err != nil {
				t.Fatal(err)
			}
			for range 2 {
				if err := l.Wait(ctx, "s"); err != nil {
					t.Fatal(err)
				}
			}
			third := make(chan error, 1)
			go func() { third <- l.Wait(ctx, "s") }()
			time.Sleep(100 * time.Millisecond)
			select {
			case err := <-third:
				t.Fatalf("a third Wait returned (%v) while both places were held", err)
			default:
			}
			if err := l.Release(ctx, "s"); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-third:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(2 * time.Second):
				t.Fatal("the third Wait did not take the released place")
			}
			k := prefix + "{s}:two"
			if ttl, err := b.Client.PTTL(ctx, k).Result(); err != nil || ttl <= 0 || ttl > 3*time.Second {
				t.Fatalf("PTTL %s = %v, %v; want a few leases", k, ttl, err)
			}
			for range 2 {
				if err := l.Release(ctx, "s"); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
