package worker_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// Five tasks for one account, paced at 5 per second by a middleware on a
// real asynq server (on miniredis here).
func ExampleNewMiddleware() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		log.Fatal(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	lim, err := throttle.New(rdb, throttle.Options{Prefix: "example:"},
		throttle.Rule{Name: "stripe", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := worker.NewMiddleware([]worker.TaskRule{{
		Name:     "stripe",
		Tasks:    []string{"stripe:*"},
		Limiter:  lim,
		Subject:  worker.PayloadField("account_id"),
		Settings: admission.Settings{MaxWait: 10 * time.Second},
	}}, worker.Options{})
	if err != nil {
		log.Fatal(err)
	}

	var done atomic.Int32
	var first, last atomic.Int64 // admission times, Unix ns
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("stripe:charge", func(ctx context.Context, t *asynq.Task) error {
		now := time.Now().UnixNano()
		first.CompareAndSwap(0, now)
		last.Store(now)
		done.Add(1)
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{Concurrency: 5, LogLevel: asynq.FatalLevel}))
	if err := srv.Start(mux); err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()

	client := asynq.NewClientFromRedisClient(rdb)
	for range 5 {
		if _, err := client.Enqueue(asynq.NewTask("stripe:charge", []byte(`{"account_id": "acct_42"}`))); err != nil {
			log.Fatal(err)
		}
	}
	for done.Load() < 5 {
		time.Sleep(10 * time.Millisecond)
	}
	// At 5 per second, burst 1, the five slots span 800ms of Redis time
	// however the tasks were picked up (less a little network jitter).
	fmt.Println("done:", done.Load(), "spread over 800ms:", time.Duration(last.Load()-first.Load()) >= 790*time.Millisecond)
	// Output:
	// done: 5 spread over 800ms: true
}

func ExampleRetryDelay() {
	retry := worker.RetryDelay(nil)
	at := time.Now().Add(90 * time.Second)
	d := retry(0, &admission.ThrottledError{Rule: "stripe", Subject: "acct_42", RetryAt: at}, nil)
	fmt.Println(d >= 90*time.Second && d <= 91*time.Second, worker.IsFailure(&admission.ThrottledError{}), worker.IsFailure(errors.New("boom")))
	// Output:
	// true false true
}
