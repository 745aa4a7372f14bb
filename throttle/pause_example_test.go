package throttle_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

func ExampleLimiter_PauseFor() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()

	lim, err := throttle.New(rdb, throttle.Options{Prefix: "myapp:"},
		throttle.Rule{Name: "api", Algorithm: throttle.TokenBucket, Limit: throttle.PerSecond(10)})
	if err != nil {
		panic(err)
	}
	// The upstream said: come back in 2 seconds. Every process that uses
	// this Redis, prefix and rule now waits for that.
	if _, err := lim.PauseFor(ctx, "api.example.com", 2*time.Second); err != nil {
		panic(err)
	}
	res, _ := lim.Allow(ctx, "api.example.com")
	left, _ := lim.PauseFor(ctx, "api.example.com", 0)
	fmt.Printf("allowed=%v retry after %v; paused for %v\n", res.Allowed, res.RetryAfter, left)
	// Output:
	// allowed=false retry after 2s; paused for 2s
}

// A producer books each job's slot and passes the receipt with the job;
// the consumer redeems it instead of charging the rule a second time.
func ExampleLimiter_PrepayN() {
	rdb, stop := exampleRedis()
	defer stop()
	ctx := context.Background()
	rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(1)}

	producer, _ := throttle.New(rdb, throttle.Options{Prefix: "myapp:"}, rule)
	var receipts []string
	for range 3 {
		r, err := producer.PrepayN(ctx, "tenant-7", 1, time.Hour)
		if err != nil {
			panic(err)
		}
		// Schedule the job for its slot; Delay counts down to it.
		fmt.Println("job due in", r.Delay().Round(10*time.Millisecond))
		id, _ := r.Receipt()
		receipts = append(receipts, id)
	}

	consumer, _ := throttle.New(rdb, throttle.Options{Prefix: "myapp:"}, rule)
	job := throttle.AdmitRequest{Subject: "tenant-7", N: 1, Caller: throttle.Caller{Receipt: receipts[2]}, Wait: time.Second, Tolerance: time.Second}
	a, _ := consumer.Admit(ctx, job)
	fmt.Printf("redeemed=%v, wait %v for the slot\n", a.Status == throttle.Redeemed, a.Delay.Round(10*time.Millisecond))
	a, _ = consumer.Admit(ctx, job)
	fmt.Printf("again: redeemed=%v (a new turn, %v)\n", a.Status == throttle.Redeemed, a.Delay.Round(10*time.Millisecond))
	// Output:
	// job due in 0s
	// job due in 50ms
	// job due in 100ms
	// redeemed=true, wait 100ms for the slot
	// again: redeemed=false (a new turn, 150ms)
}
