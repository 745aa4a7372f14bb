package reliability

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
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

// asynqBed is an asynq server behind the worker middleware, on a
// redis-server the test controls, with a handler that counts each task by
// the number in its payload.
type asynqBed struct {
	t    *testing.T
	srv  *redistest.Proc
	rdb  *redis.Client
	insp *asynq.Inspector
	// rules builds the middleware's rules on a client (each server
	// startServer starts has its own).
	rules func(rdb redis.UniversalClient) []worker.TaskRule

	mu      sync.Mutex
	seen    map[int]int         // payload n -> handler runs
	runs    map[int][]time.Time // payload n -> when the handler ran
	handled atomic.Int32
	errs    []string // what asynq's ErrorHandler saw
}

// newAsynqBed starts an asynq server (concurrency 20) whose tasks of type
// "e2e:*" go through the middleware rule mw builds on the bed's client.
func newAsynqBed(t *testing.T, srv *redistest.Proc, rules func(rdb redis.UniversalClient) []worker.TaskRule) *asynqBed {
	t.Helper()
	b := &asynqBed{t: t, srv: srv, seen: map[int]int{}, runs: map[int][]time.Time{}}
	b.rdb = redis.NewClient(recommendedOptions(srv.Addr()))
	t.Cleanup(func() { _ = b.rdb.Close() })
	b.insp = asynq.NewInspectorFromRedisClient(b.rdb)
	b.rules = rules
	b.startServer()
	return b
}

// startServer starts an asynq server (concurrency 20) with its own
// middleware on the bed's rules, and the bed's handler: a worker process.
func (b *asynqBed) startServer() {
	t := b.t
	mw, err := worker.NewMiddleware(b.rules(b.rdb), worker.Options{Asynq: b.rdb, Logger: slogLogger(newLogRecorder())})
	if err != nil {
		t.Fatal(err)
	}
	as := asynq.NewServerFromRedisClient(b.rdb, worker.Configure(asynq.Config{
		Concurrency:              20,
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 200 * time.Millisecond,
		ShutdownTimeout:          3 * time.Second,
		// The application's own retry policy (for failures that are not
		// the middleware's deferrals): retry after a second, so that the
		// test does not wait out asynq's default 15-45s backoff.
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
		LogLevel:       asynqLogLevel(),
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, task *asynq.Task, err error) {
			b.mu.Lock()
			defer b.mu.Unlock()
			if len(b.errs) < 1000 {
				b.errs = append(b.errs, err.Error())
			}
		}),
	}))
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("e2e", func(ctx context.Context, task *asynq.Task) error {
		var p struct{ N int }
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return fmt.Errorf("handler: %v: %w", err, asynq.SkipRetry)
		}
		b.mu.Lock()
		b.seen[p.N]++
		b.runs[p.N] = append(b.runs[p.N], time.Now())
		b.mu.Unlock()
		b.handled.Add(1)
		return nil
	})
	if err := as.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mw.Drain(); as.Shutdown() })
}

// enqueue puts n tasks of type typ(i) with payload {"n": i, "tenant": ...}
// (payload(i) if non-nil) in the default queue, kept an hour once done.
func (b *asynqBed) enqueue(n int, typ func(i int) string, payload func(i int) string) {
	b.t.Helper()
	// The producer is the test's, not what it tests: its own client, whose
	// reads wait longer than the bed's 1s (a write with appendfsync always
	// on a loaded machine took longer once, and failed the test there).
	prod := redis.NewClient(&redis.Options{Addr: b.srv.Addr(), ReadTimeout: 10 * time.Second, WriteTimeout: 10 * time.Second})
	defer prod.Close()
	c := asynq.NewClientFromRedisClient(prod)
	for i := range n {
		p := fmt.Sprintf(`{"n": %d, "tenant": "t%d"}`, i, i%4)
		if payload != nil {
			p = payload(i)
		}
		if _, err := c.Enqueue(asynq.NewTask(typ(i), []byte(p)), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			b.t.Fatalf("enqueue %d: %v", i, err)
		}
	}
}

// waitQueue waits until the default queue holds nothing pending, active,
// scheduled or to retry, and returns its info.
func (b *asynqBed) waitQueue(d time.Duration) *asynq.QueueInfo {
	b.t.Helper()
	var qi *asynq.QueueInfo
	for deadline := time.Now().Add(d); ; time.Sleep(100 * time.Millisecond) {
		var err error
		qi, err = b.insp.GetQueueInfo("default")
		if err == nil && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0 {
			return qi
		}
		if time.Now().After(deadline) {
			active, _ := b.insp.ListActiveTasks("default")
			var desc []string
			for _, a := range active[:min(len(active), 3)] {
				desc = append(desc, fmt.Sprintf("%s %s retried=%d lastErr=%q", a.ID, a.Payload, a.Retried, a.LastErr))
			}
			b.mu.Lock()
			ran := len(b.seen)
			b.mu.Unlock()
			b.t.Fatalf("queue not drained within %v: %+v (%v); %d payloads ran; active: %v", d, qi, err, ran, desc)
		}
	}
}

// TestAsynqThroughRedisOutage sends 1,000 tasks through 20 throttled asynq
// workers on a redis-server with AOF (appendfsync always): half under a
// GCRA rule (50/s per tenant, 4 tenants: reservations), half under a fixed
// window (10 per 100ms: waiters queued in the limiter, asking Redis).
// 300 tasks in, Redis stops for 5s and restarts from its AOF. Then:
//
//   - no task is lost: every payload reaches the handler;
//   - none is archived, and none failed because of throttling: a deferral
//     (Redis unreachable, wait too long) never counts as a failure;
//   - the handler sees each task exactly once, except for what asynq
//     v0.26 itself cannot do: a handler that finishes while Redis is down
//     gets its completion retried with a context asynq has already
//     cancelled (processor.go, markAsComplete/markAsDone/retry: the retry
//     closure captures ctx after "defer cancel()"), so the task stays
//     active until its lease expires and asynq's recoverer runs it again,
//     counting ErrLeaseExpired as a failure (Retried 1). (The test ages
//     those leases and starts a second server, whose recoverer takes them
//     back at once, instead of waiting out asynq's lease and recoverer
//     period: see recovery_test.go.) The test allows
//     exactly those tasks (at most the 20 in flight when Redis stopped, each
//     first run while Redis was down, asynq's lease error their only
//     failure) and reports them; see RELIABILITY.md.
func TestAsynqThroughRedisOutage(t *testing.T) {
	t.Parallel()
	srv := redistest.Server(t, redistest.Args("--appendonly", "yes", "--appendfsync", "always"))
	const tasks, concurrency = 1000, 20
	prefix := redistest.Prefix(t) // one for every server of the bed: they share the limits
	b := newAsynqBed(t, srv, func(rdb redis.UniversalClient) []worker.TaskRule {
		bucket, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "bucket", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(50).WithBurst(5)})
		if err != nil {
			t.Fatal(err)
		}
		window, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "window", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 10, Period: 100 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		return []worker.TaskRule{
			{Name: "bucket", Tasks: []string{"e2e:bucket"}, Limiter: bucket, Subject: worker.PayloadField("tenant")},
			{Name: "window", Tasks: []string{"e2e:window"}, Limiter: window, Subject: worker.Fixed("all")},
		}
	})
	start := time.Now()
	b.enqueue(tasks, func(i int) string { return [2]string{"e2e:bucket", "e2e:window"}[i%2] }, nil)
	for b.handled.Load() < 300 {
		if time.Since(start) > time.Minute {
			t.Fatalf("only %d tasks handled in a minute", b.handled.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	before := b.handled.Load()
	srv.Stop()
	stopped := time.Now()
	time.Sleep(5 * time.Second)
	during := b.handled.Load() - before
	srv.Restart(t)
	restarted := time.Now()
	// The tasks asynq lost track of while Redis was down (a completion, or
	// the reply to a dequeue, lost) stay active until asynq's recoverer
	// takes them back: their leases, which no worker extends since the
	// restart, are aged instead of waited out (see recovery_test.go), and a
	// second worker's recoverer, run as it starts, takes them back.
	lost := leasesHeldSince(t, b.rdb, "default", restarted)
	ageLeases(t, b.rdb, "default", lost)
	b.startServer()
	for b.handled.Load() < tasks {
		if time.Since(restarted) > 3*time.Minute {
			t.Fatalf("only %d of %d tasks handled 3 minutes after the restart", b.handled.Load(), tasks)
		}
		time.Sleep(20 * time.Millisecond)
	}
	allRan := time.Since(restarted)
	qi := b.waitQueue(time.Minute)
	drained := time.Since(restarted)

	completed, err := b.insp.ListCompletedTasks("default", asynq.PageSize(2*tasks))
	if err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var missing []int
	rerun := map[int]bool{}
	for i := range tasks {
		switch n := b.seen[i]; {
		case n == 0:
			missing = append(missing, i)
		case n > 1:
			rerun[i] = true
			if first := b.runs[i][0]; first.Before(stopped.Add(-time.Second)) || first.After(restarted) {
				t.Errorf("task %d ran %d times, first at %v from the stop: not a completion lost while Redis was down", i, n, first.Sub(stopped))
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("%d tasks never reached the handler: %v", len(missing), head(missing))
	}
	if len(rerun) > concurrency {
		t.Errorf("%d tasks ran more than once; at most the %d in flight when Redis stopped may (asynq's lost completions)", len(rerun), concurrency)
	}
	if qi.Archived != 0 {
		t.Errorf("%d tasks archived; want none", qi.Archived)
	}
	failedByLease, failedOther := 0, 0
	for _, ti := range completed {
		if ti.Retried == 0 {
			continue
		}
		// A task whose lease was aged (lost) counts asynq's one failure for
		// the lease; after it ran again it may have parked, and its last
		// error is then the park, which counted nothing.
		if strings.Contains(ti.LastErr, asynq.ErrLeaseExpired.Error()) || (ti.Retried == 1 && slices.Contains(lost, ti.ID)) {
			failedByLease++
			continue
		}
		failedOther++
		t.Errorf("task %s counted a failure: %q; a throttled or deferred task must never count one", ti.ID, ti.LastErr)
	}
	if len(completed) != tasks {
		t.Errorf("%d completed tasks; want %d", len(completed), tasks)
	}
	t.Logf("%d tasks (half GCRA, half fixed window): %d handled before the stop, %d during the 5s outage (in flight), all handled %v after the restart, queue drained %v after it (%d leases aged)",
		tasks, before, during, allRan.Round(time.Millisecond), drained.Round(time.Millisecond), len(lost))
	t.Logf("exactly once: %d tasks; run twice (completion lost by asynq v0.26 while Redis was down): %d; failures counted: %d by asynq's lease expiry, %d other; archived %d; %d handler errors seen by asynq (deferrals)",
		tasks-len(rerun)-len(missing), len(rerun), failedByLease, failedOther, qi.Archived, len(b.errs))
}

// TestMalformedPayloads enqueues 200 good tasks and 50 whose payloads
// cannot give a subject (not JSON, not an object, no tenant field, a null,
// an empty, an object or a too-long tenant) in one queue. Each malformed
// task must be archived once, at its first attempt, with a reason that
// says why (asynq.SkipRetry: Retried == 0), and the good tasks must all
// run, none blocked behind the bad ones.
func TestMalformedPayloads(t *testing.T) {
	srv := redistest.Server(t)
	b := newAsynqBed(t, srv, func(rdb redis.UniversalClient) []worker.TaskRule {
		lim, err := throttle.New(rdb, throttle.Options{Prefix: redistest.Prefix(t)},
			throttle.Rule{Name: "e2e", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(200).WithBurst(20)})
		if err != nil {
			t.Fatal(err)
		}
		return []worker.TaskRule{{Name: "e2e", Tasks: []string{"e2e:*"}, Limiter: lim, Subject: worker.PayloadField("tenant")}}
	})
	bad := []string{
		`not json`, `[1,2,3]`, `"a string"`, `{"n": 1}`, `{"tenant": null}`, `{"tenant": ""}`,
		`{"tenant": {"a": 1}}`, `{"tenant": true}`, `{"tenant": "` + strings.Repeat("x", 1024+1) + `"}`, ``,
	}
	const good, badCount = 200, 50
	b.enqueue(good+badCount, func(int) string { return "e2e:task" }, func(i int) string {
		if i%5 == 4 { // every fifth task is bad, spread through the queue
			return bad[(i/5)%len(bad)]
		}
		return fmt.Sprintf(`{"n": %d, "tenant": "t%d"}`, i, i%4)
	})
	start := time.Now()
	qi := b.waitQueue(time.Minute)
	took := time.Since(start)
	if qi.Archived != badCount {
		t.Errorf("%d tasks archived; want the %d bad ones", qi.Archived, badCount)
	}
	archived, err := b.insp.ListArchivedTasks("default", asynq.PageSize(100))
	if err != nil {
		t.Fatal(err)
	}
	reasons := map[string]int{}
	for _, ti := range archived {
		if ti.Retried != 0 {
			t.Errorf("archived task %s was retried %d times; want archived at its first attempt", ti.ID, ti.Retried)
		}
		if !strings.Contains(ti.LastErr, "subject") && !strings.Contains(ti.LastErr, "payload") {
			t.Errorf("archived task %s: reason %q does not say what is wrong", ti.ID, ti.LastErr)
		}
		_, why, _ := strings.Cut(ti.LastErr, "): ") // drop the task id
		reasons[why[:min(len(why), 70)]]++
	}
	b.mu.Lock()
	ran := len(b.seen)
	b.mu.Unlock()
	if ran != good {
		t.Errorf("%d good tasks ran; want all %d", ran, good)
	}
	t.Logf("%d good tasks ran and %d bad ones were archived at once, in %v; reasons: %v", ran, qi.Archived, took.Round(time.Millisecond), reasons)
}

// head returns the first few elements of s, for messages.
func head[T any](s []T) []T { return s[:min(len(s), 5)] }

// asynqLogLevel is asynq's log level in these tests: silent, or warnings
// when JT_ASYNQ_LOG is set (to watch what asynq does in an outage).
func asynqLogLevel() asynq.LogLevel {
	if os.Getenv("JT_ASYNQ_LOG") != "" {
		return asynq.WarnLevel
	}
	return asynq.FatalLevel
}
