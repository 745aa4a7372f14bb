// Multi-tenant: a per-tenant policy and a global limit in one limiter, the
// global rule over one subject for everyone (Rule.Subject). A noisy tenant's backlog waits for its own
// limit, deferred out of the worker slots, while the other tenants' tasks
// run at once. Run it with
//
//	go run ./examples/multi-tenant
//
// No Redis is needed: it starts an in-memory one on loopback.
//
// It uses throttle and worker, and internal/devredis; as a program, nothing imports it.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// The workload: the noisy tenant enqueues its backlog first; the others
// come after it in the same queue.
var workload = []struct {
	tenant string
	tasks  int
}{
	{"noisy", 40},
	{"acme", 5},
	{"globex", 5},
	{"initech", 5},
}

func main() {
	log.SetFlags(0)
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()
	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()
	opts := throttle.Options{Prefix: "multi-tenant:"}

	// Per tenant, a policy of two limits decided atomically in one script:
	// 5 per second (leaky bucket, bursts of 5) and 100 per minute (token
	// bucket). Both reserve, so every deferral carries the exact time of the
	// tenant's next free slot.
	// The tenant's limits come first, so that a tenant over its own limit
	// never takes global capacity: the global rule is over one subject for
	// everyone ("all"), and a request it refuses gives back the tenant's
	// permits.
	limiter, err := throttle.New(rdb, opts,
		throttle.Rule{Name: "per-second", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5)},
		throttle.Rule{Name: "per-minute", Algorithm: throttle.TokenBucket, Limit: throttle.Limit{Count: 100, Period: time.Minute, Burst: 100}},
		// For everyone together: 30 per second, a ceiling for the shared backend.
		throttle.Rule{Name: "global", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(30).WithBurst(10), Subject: "all"},
	)
	if err != nil {
		log.Fatal(err)
	}
	mw, err := worker.NewMiddleware([]worker.TaskRule{{
		Name:    "reports",
		Tasks:   []string{"report:*"},
		Limiter: limiter,
		Subject: worker.PayloadField("tenant"),
		// A task waits in its worker slot at most this long; a later
		// admission is deferred, which frees the slot for other tenants.
		Settings: admission.Settings{MaxWait: 300 * time.Millisecond},
	}}, worker.Options{Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		log.Fatal(err)
	}

	type result struct{ first, last time.Duration }
	var mu sync.Mutex
	results := map[string]*result{}
	total := 0
	for _, w := range workload {
		total += w.tasks
	}
	done := make(chan struct{})
	var start time.Time

	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("report:build", func(ctx context.Context, t *asynq.Task) error {
		var p struct{ Tenant string }
		if err := json.Unmarshal(t.Payload(), &p); err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		at := time.Since(start)
		r := results[p.Tenant]
		if r == nil {
			r = &result{first: at}
			results[p.Tenant] = r
		}
		r.last = at
		if total--; total == 0 {
			close(done)
		}
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency:       10,
		TaskCheckInterval: 100 * time.Millisecond,
		// How often asynq moves due deferred tasks back to their queue
		// (Configure's default is 1s): a short demo wants them back soon.
		DelayedTaskCheckInterval: 250 * time.Millisecond,
		LogLevel:                 asynq.ErrorLevel,
	}))

	client := asynq.NewClientFromRedisClient(rdb)
	for _, w := range workload {
		for i := range w.tasks {
			payload := fmt.Sprintf(`{"tenant": %q, "n": %d}`, w.tenant, i)
			if _, err := client.Enqueue(asynq.NewTask("report:build", []byte(payload)), asynq.MaxRetry(3)); err != nil {
				log.Fatal(err)
			}
		}
	}
	fmt.Println("jobthrottle multi-tenant: per tenant 5/s and 100/min; all tenants together 30/s.")
	fmt.Println("Queued in this order: noisy 40 tasks, then acme, globex and initech 5 each; one worker, 10 slots.")
	fmt.Println()

	mu.Lock()
	start = time.Now()
	mu.Unlock()
	if err := srv.Start(mux); err != nil {
		log.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		log.Fatal("multi-tenant: the tasks did not finish within 60s")
	}
	srv.Shutdown()

	fmt.Println("tenant    tasks   first done   last done")
	for _, w := range workload {
		r := results[w.tenant]
		fmt.Printf("%-8s  %5d   %9.1fs  %9.1fs\n", w.tenant, w.tasks, r.first.Seconds(), r.last.Seconds())
	}
	q, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo("default")
	if err != nil {
		log.Fatal(err)
	}
	var quiet time.Duration
	for _, w := range workload[1:] {
		quiet = max(quiet, results[w.tenant].last)
	}
	fmt.Printf("\nThe quiet tenants were done within %.1fs; the noisy one took %.1fs at its own 5/s,\n", quiet.Seconds(), results["noisy"].last.Seconds())
	fmt.Printf("its tasks deferred (not failed: %d failed, %d archived) while they waited their turn.\n", q.FailedTotal, q.Archived)
}
