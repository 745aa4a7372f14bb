package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/redis/go-redis/v9"
)

// exampleRedis starts an in-process Redis whose clock stands still, so the
// examples print the same thing every run. Use a real Redis in production.
func exampleRedis() (*redis.Client, func()) {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	m.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	return rdb, func() { rdb.Close(); m.Close() }
}

func Example() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	// 20 calls a second per account, shared by every process on this Redis.
	lim, err := throttle.New(rdb, throttle.Options{Prefix: "myapp:"},
		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(2)},
	)
	if err != nil {
		panic(err)
	}
	for range 3 {
		res, err := lim.Allow(ctx, "account-42")
		if err != nil {
			panic(err)
		}
		fmt.Printf("allowed=%v remaining=%d retry after %v\n", res.Allowed, res.Remaining, res.RetryAfter)
	}
	// Output:
	// allowed=true remaining=1 retry after 0s
	// allowed=true remaining=0 retry after 0s
	// allowed=false remaining=0 retry after 50ms
}

// A policy: several limits over one subject, checked and charged together.
func ExampleNew_policy() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	lim, err := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "burst", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 200, Period: 10 * time.Second}},
		throttle.Rule{Name: "hourly", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 5000, Period: time.Hour, Burst: 5000}},
		throttle.Rule{Name: "daily", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 3, Period: 24 * time.Hour, Burst: 3}},
	)
	if err != nil {
		panic(err)
	}
	for range 4 {
		res, _ := lim.Allow(ctx, "tenant-7")
		fmt.Printf("allowed=%v decided by %s, retry after %v\n", res.Allowed, res.Rule, res.RetryAfter)
	}
	// Output:
	// allowed=true decided by daily, retry after 0s
	// allowed=true decided by daily, retry after 0s
	// allowed=true decided by daily, retry after 0s
	// allowed=false decided by daily, retry after 24h0m0s
}

// Wait blocks until the permit is granted, or fails at once if it would
// come after the context's deadline.
func ExampleLimiter_Wait() {
	rdb, stop := exampleRedis()
	defer stop()

	lim, _ := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "nightly", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 1, Period: time.Hour, Burst: 1}},
	)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fmt.Println("first:", lim.Wait(ctx, "export"))

	err := lim.Wait(ctx, "export")
	var de *throttle.DelayError
	if errors.As(err, &de) {
		fmt.Println("second: deadline exceeded:", errors.Is(err, context.DeadlineExceeded), "- admitted in", de.RetryAfter)
	}
	// Output:
	// first: <nil>
	// second: deadline exceeded: true - admitted in 1h0m0s
}

// Reserve books a future slot in one round trip; Cancel gives it back.
func ExampleLimiter_ReserveN() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	lim, _ := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)},
	)
	for range 3 {
		r, err := lim.ReserveN(ctx, "host", 1)
		if err != nil {
			panic(err)
		}
		// Delay counts down from the reply (as in x/time/rate); rounded
		// here for a stable output.
		fmt.Println("act in", r.Delay().Round(10*time.Millisecond))
	}
	// Output:
	// act in 0s
	// act in 100ms
	// act in 200ms
}

// Rules over different subjects: a limit per tenant, and one global
// limit (Rule.Subject) that every tenant shares. A request charges both or
// neither.
func ExampleRule_subject() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	lim, _ := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "tenant", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 2, Period: time.Minute}},
		throttle.Rule{Name: "global", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 3, Period: time.Minute}, Subject: "all"})
	for _, tenant := range []string{"a", "a", "a", "b", "c"} {
		res, _ := lim.Allow(ctx, tenant)
		fmt.Printf("%s: allowed=%v (%s)\n", tenant, res.Allowed, res.Rule)
	}
	// Output:
	// a: allowed=true (tenant)
	// a: allowed=true (tenant)
	// a: allowed=false (tenant)
	// b: allowed=true (global)
	// c: allowed=false (global)
}

// At most two exports of a tenant run at once, across every process:
// Acquire takes one of the two places (queueing, first come first served,
// while both are taken) and hands it back; its Release gives it back. The
// limiter renews the leases of the places it holds; a process that dies
// loses them within the lease.
func ExamplePlace_Release() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	lim, err := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "exports", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: 30 * time.Second}},
	)
	if err != nil {
		panic(err)
	}
	defer lim.Close()
	places := make([]*throttle.Place, 3)
	for i := range 2 {
		if places[i], err = lim.Acquire(ctx, "tenant-7", 1); err != nil {
			panic(err)
		}
		fmt.Println("export", i, "holds a place")
	}
	third := make(chan struct{})
	go func() {
		var err error
		if places[2], err = lim.Acquire(ctx, "tenant-7", 1); err != nil {
			panic(err)
		}
		close(third)
	}()
	time.Sleep(50 * time.Millisecond)
	fmt.Println("export 2 waits; export 0 ends")
	if err := places[0].Release(ctx); err != nil {
		panic(err)
	}
	<-third
	fmt.Println("export 2 holds a place")
	for _, p := range places[1:] {
		_ = p.Release(ctx)
	}
	// Output:
	// export 0 holds a place
	// export 1 holds a place
	// export 2 waits; export 0 ends
	// export 2 holds a place
}
