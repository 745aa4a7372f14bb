package jobthrottle_test

// End-to-end test of concurrency rules (issue 10): real asynq servers and
// client, a real redis-server, the worker middleware with wake-ups. The
// kill -9 half is reliability/concurrency_test.go.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// opCounter counts a limiter client's script calls by operation: the
// scripts' ARGV[1] (admit) or lease.lua's (renew, release).
type opCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *opCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *opCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); name == "evalsha" || name == "eval" {
			args := cmd.Args()
			nkeys, _ := args[2].(int)
			op := fmt.Sprint(args[3+nkeys])
			if op == "admit" && fmt.Sprint(args[4+nkeys]) == "0" {
				op = "sweep" // Admit with N = 0: the sweep of a subject
			}
			c.mu.Lock()
			c.n[op]++
			c.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (c *opCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestConcurrencyBacklog: a rule of at most 3 tasks at once (lease 2s)
// across three worker processes (asynq servers of concurrency 5, each
// with its own middleware and limiter), 300 tasks of one subject enqueued
// at once, each running 20ms. Never more than 3 run at once, measured in
// the handlers; every task runs once, none fails; and the limiter calls
// per task stay at most 3 (a parked task: admit, admit again when handed a
// place, release), renewals and sweeps counted apart.
func TestConcurrencyBacklog(t *testing.T) {
	t.Parallel()
	const n, places, work = 300, 3, 20 * time.Millisecond
	proc := redistest.Server(t)
	prefix := redistest.Prefix(t)
	rule := throttle.Rule{Name: "running", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: places, Period: 2 * time.Second}}
	ops := &opCounter{n: map[string]int{}}

	var running, most atomic.Int64
	var mu sync.Mutex
	runs := map[string]int{}
	var parks atomic.Int64
	var errs []error
	for range 3 {
		rdb := proc.Client(t)
		limRDB := proc.Client(t)
		limRDB.AddHook(ops)
		lim, err := throttle.New(limRDB, throttle.Options{Prefix: prefix, OnHandoff: worker.WakeOnHandoff(rdb), Logger: slog.New(slog.DiscardHandler)}, rule)
		if err != nil {
			t.Fatal(err)
		}
		mw, err := worker.NewMiddleware([]worker.TaskRule{{Name: "running", Tasks: []string{"job:*"}, Limiter: lim, Subject: worker.Fixed("all")}},
			worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		mux.HandleFunc("job:", func(ctx context.Context, task *asynq.Task) error {
			now := running.Add(1)
			for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
			}
			time.Sleep(work)
			running.Add(-1)
			id, _ := asynq.GetTaskID(ctx)
			mu.Lock()
			runs[id]++
			mu.Unlock()
			return nil
		})
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
			Concurrency: 5,
			LogLevel:    asynq.FatalLevel,
			ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
				if errors.Is(err, worker.ErrParked) {
					parks.Add(1)
					return
				}
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}),
		}))
		if err := srv.Start(mux); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Shutdown(); mw.Drain() })
	}

	client := asynq.NewClientFromRedisClient(proc.Client(t))
	ids := map[string]bool{}
	start := time.Now()
	for range n {
		info, err := client.Enqueue(asynq.NewTask("job:run", nil), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ids[info.ID] = true
	}
	insp := asynq.NewInspectorFromRedisClient(proc.Client(t))
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		q, err := insp.GetQueueInfo("default")
		if err == nil && q.Completed == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v completed of %d within 60s", q, n)
		}
	}
	took := time.Since(start)

	if m := most.Load(); m > places {
		t.Errorf("%d tasks ran at once, want at most %d", m, places)
	}
	mu.Lock()
	defer mu.Unlock()
	for id := range ids {
		if runs[id] != 1 {
			t.Errorf("task %s ran %d times, want once", id, runs[id])
		}
	}
	if len(errs) > 0 {
		t.Errorf("%d handler errors other than parking, first: %v", len(errs), errs[0])
	}
	ops.mu.Lock()
	defer ops.mu.Unlock()
	perTask := float64(ops.n["admit"]+ops.n["release"]) / n
	t.Logf("%d tasks, at most %d at once, in %v (%.0f/s; %d at once × %v each is at most %.0f/s); parks %d; limiter calls per task %.2f (admit %d, release %d); apart: renewals %d, sweeps %d",
		n, most.Load(), took.Round(time.Millisecond), n/took.Seconds(), places, work, places/work.Seconds(), parks.Load(), perTask, ops.n["admit"], ops.n["release"], ops.n["renew"], ops.n["sweep"])
	if ops.n["release"] != n {
		t.Errorf("%d places released, want %d: one per task", ops.n["release"], n)
	}
	if perTask > 3 {
		t.Errorf("limiter calls per task: %.2f, want at most 3", perTask)
	}
}
