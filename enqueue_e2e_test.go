package jobthrottle_test

// End-to-end, for the outbound and enqueue halves: real asynq servers and
// client on a real redis-server, httpthrottle.Transport in front of a real
// HTTP server, and batches paced by package enqueue.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// startWorker starts an asynq server with the given middleware (nil for
// none) and handler for every task type, on its own connection to proc,
// and stops it when the test ends.
func startWorker(t *testing.T, proc *redistest.Proc, concurrency int, mw func(asynq.Handler) asynq.Handler, h asynq.HandlerFunc) {
	t.Helper()
	var handler asynq.Handler = h
	if mw != nil {
		handler = mw(h)
	}
	srv := asynq.NewServerFromRedisClient(proc.Client(t), worker.Configure(asynq.Config{
		Concurrency:              concurrency,
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.FatalLevel,
	}))
	if err := srv.Start(handler); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
}

// gatedAPI is a third-party API that answers its first request 429 with
// Retry-After: 2 and keeps its gate shut for those 2 seconds: any request
// in that time would get a second 429.
type gatedAPI struct {
	mu      sync.Mutex
	first   time.Time
	calls   []apiCall
	tooMany int
}

type apiCall struct {
	at     time.Time
	worker string
}

func (a *gatedAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	a.calls = append(a.calls, apiCall{at: now, worker: r.Header.Get("X-Worker")})
	if a.first.IsZero() {
		a.first = now
	}
	if len(a.calls) == 1 || now.Before(a.first.Add(2*time.Second)) {
		a.tooMany++
		w.Header().Set("Retry-After", "2")
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	fmt.Fprintln(w, "ok")
}

// One 429 with Retry-After: 2 pauses every worker of the fleet, each with
// its own connection, limiter and transport: the API sees no request
// during its 2 seconds, so no second 429.
func TestTransportPausesFleet(t *testing.T) {
	proc := redistest.Server(t)
	api := &gatedAPI{}
	srv := httptest.NewServer(api)
	defer srv.Close()
	prefix := redistest.Prefix(t)

	const tasks = 24
	var mu sync.Mutex
	done := 0
	allDone := make(chan struct{})
	for _, name := range []string{"A", "B", "C"} {
		lim, err := throttle.New(proc.Client(t), throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		if err != nil {
			t.Fatal(err)
		}
		tr, err := httpthrottle.New(lim, httpthrottle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		client := &http.Client{Transport: tr}
		startWorker(t, proc, 4, nil, func(ctx context.Context, task *asynq.Task) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
			req.Header.Set("X-Worker", name)
			resp, err := client.Do(req)
			if err != nil {
				t.Errorf("worker %s: %v", name, err)
				return nil
			}
			resp.Body.Close()
			mu.Lock()
			defer mu.Unlock()
			if done++; done == tasks {
				close(allDone)
			}
			return nil
		})
	}
	client := asynq.NewClientFromRedisClient(proc.Client(t))
	for i := range tasks {
		if _, err := client.Enqueue(asynq.NewTask("call", []byte(fmt.Sprint(i)))); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-allDone:
	case <-time.After(40 * time.Second): // liveness; the pace is asserted below
		t.Fatal("the tasks did not finish within 40s")
	}

	api.mu.Lock()
	defer api.mu.Unlock()
	if api.tooMany != 1 {
		t.Errorf("the API answered %d 429s, want 1", api.tooMany)
	}
	gate := api.first.Add(2 * time.Second)
	after := map[string]int{}
	for _, c := range api.calls[1:] {
		if c.at.Before(gate) {
			t.Errorf("worker %s called at %v, during the pause (the gate opens at 2s)", c.worker, c.at.Sub(api.first))
		}
		after[c.worker]++
	}
	if len(after) != 3 {
		t.Errorf("calls after the pause by worker: %v; want all three workers", after)
	}
	if last := api.calls[len(api.calls)-1].at.Sub(api.first); last > 2*time.Second+tasks*100*time.Millisecond+time.Second {
		t.Errorf("last call at %v: the pause held the workers longer than it should", last)
	}
}

// 100 tasks enqueued paced at 20/s under the workers' rule run at their
// slots, 50 ms apart, on their prepaid receipts: no worker waits for a
// permit and none is charged twice. asynq schedules in whole seconds, so a
// task reaches a worker up to a second before its slot and the middleware
// holds it until then; with Lead, none reaches it after.
func TestPacedBatchRunsAtItsSlots(t *testing.T) {
	proc := redistest.Server(t)
	prefix := redistest.Prefix(t)
	cfg, err := rules.Parse("rules.yaml", []byte(`prefix: "`+prefix+`"
rules:
  - name: partner
    tasks: ["paced:*"]
    subject: {fixed: partner}
    algorithm: gcra
    limit: 20
    period: 1s
    burst: 1
`))
	if err != nil {
		t.Fatal(err)
	}
	const tasks = 100
	const interval = 50 * time.Millisecond

	type start struct {
		at   time.Time
		wait admission.Wait
	}
	var mu sync.Mutex
	starts := map[int]start{}
	allDone := make(chan struct{})
	for range 2 {
		rdb := proc.Client(t)
		mw, err := worker.FromRules(cfg, rdb, worker.Options{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		startWorker(t, proc, 40, mw.Wrap, func(ctx context.Context, task *asynq.Task) error {
			var p struct{ I int }
			if err := json.Unmarshal(task.Payload(), &p); err != nil {
				t.Error(err)
			}
			w, _ := admission.WaitedFrom(ctx)
			mu.Lock()
			defer mu.Unlock()
			starts[p.I] = start{at: time.Now(), wait: w}
			if len(starts) == tasks {
				close(allDone)
			}
			return nil
		})
	}

	rdb := proc.Client(t)
	spec := enqueue.PaceSpec{Rules: cfg, Lead: 200 * time.Millisecond}
	pacer, err := spec.Pacer(rdb, "paced:job", throttle.Options{})
	if err != nil {
		t.Fatal(err)
	}
	payloads := make([][]byte, tasks)
	for i := range payloads {
		payloads[i] = fmt.Appendf(nil, `{"i": %d}`, i)
	}
	slots := make([]time.Time, tasks)
	b := enqueue.Batch{Type: "paced:job", Payloads: payloads, Pacer: pacer,
		OnEnqueued: func(e enqueue.Enqueued) { slots[e.Index] = e.Due }}
	res, err := b.Run(context.Background(), asynq.NewClientFromRedisClient(rdb))
	if err != nil {
		t.Fatal(err)
	}
	if res.Enqueued != tasks {
		t.Fatalf("enqueued %d, want %d", res.Enqueued, tasks)
	}
	// Due times are Redis-time delays turned into local times when each
	// reply came, so they carry the round trip's jitter (on a loaded
	// machine, tens of milliseconds): only a gross error shows here. The
	// slots themselves are checked on the Redis clock below.
	for i := 1; i < tasks; i++ {
		if off := slots[i].Sub(slots[0]) - time.Duration(i)*interval; off < -250*time.Millisecond || off > 250*time.Millisecond {
			t.Fatalf("slot %d is due %v after slot 0, want about %v", i, slots[i].Sub(slots[0]), time.Duration(i)*interval)
		}
	}
	select {
	case <-allDone:
	case <-time.After(tasks*interval + 10*time.Second):
		t.Fatal("the tasks did not finish in time")
	}

	mu.Lock()
	defer mu.Unlock()
	// The turns the tasks ran on, on the Redis clock: the pacer's receipts
	// lie on a grid of one interval. A task that came back late for its
	// receipt runs on it as late as it came (within the tolerance, checked
	// below), so the grid is taken from the earliest, and most tasks must
	// sit on it to the millisecond.
	var base time.Duration
	for i := range tasks {
		if off := starts[i].wait.Turn.Sub(starts[0].wait.Turn) - time.Duration(i)*interval; i == 0 || off < base {
			base = off
		}
	}
	onGrid := 0
	for i := range tasks {
		if off := starts[i].wait.Turn.Sub(starts[0].wait.Turn) - time.Duration(i)*interval - base; off <= time.Millisecond {
			onGrid++
		}
	}
	if onGrid < tasks*9/10 {
		t.Errorf("%d of %d turns on the Redis clock lie on the receipts' %v grid, want at least 90%%", onGrid, tasks, interval)
	}
	var maxLate, maxHold time.Duration
	var lateTasks []string
	for i := range tasks {
		s := starts[i]
		if !s.wait.Redeemed {
			t.Errorf("task %d was charged by the worker (Wait %+v), want it admitted on its receipt", i, s.wait)
		}
		late := s.at.Sub(slots[i])
		maxLate, maxHold = max(maxLate, late), max(maxHold, s.wait.Duration)
		// Both times are local estimates of one Redis time (the
		// enqueuer's when its reply came, the worker's from its own
		// replies), so they can disagree by a reply's jitter, as the
		// slots above can; Redis itself never admits early.
		if late < -10*time.Millisecond {
			t.Errorf("task %d started %v before its slot", i, -late)
		}
		// The first task's slot is the moment it is enqueued: it cannot
		// reach a worker early. Every other one must start on time.
		if i > 0 && late > interval {
			lateTasks = append(lateTasks, fmt.Sprintf("%d: %v", i, late.Round(time.Millisecond)))
		}
	}
	if len(lateTasks) > 0 {
		t.Errorf("tasks started more than one interval (%v) after their slots: %s", interval, strings.Join(lateTasks, ", "))
	}
	// Holding a task until its slot is the whole-second rounding of asynq
	// plus Lead, never a wait for a permit.
	if maxHold > time.Second+spec.Lead+200*time.Millisecond {
		t.Errorf("a worker held a task %v, more than asynq's second plus Lead", maxHold)
	}
	t.Logf("%d tasks: latest start %v after its slot; longest hold in the middleware %v (asynq's whole seconds + lead %v)",
		tasks, maxLate.Round(time.Millisecond), maxHold.Round(time.Millisecond), spec.Lead)

	// The ledger holds exactly the batch: the next permit is at most one
	// interval after the last task's start. Had the workers charged the
	// tasks again, it would be 100 intervals later.
	lim, err := cfg.Limiter(redis.UniversalClient(rdb), "partner", throttle.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := lim.Allow(context.Background(), "partner"); err != nil || (!r.Allowed && r.RetryAfter > interval) {
		t.Errorf("after the batch: Allow = %+v, %v; want a permit within %v (nothing charged twice)", r, err, interval)
	}
}
