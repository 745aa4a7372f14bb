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
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

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
	// The pause ends when the API said: the first call after it comes
	// within 1.5 s of the gate (a pause held twice over: 2 s late). How
	// fast the backlog drains after it is machine speed, not the pause's
	// (beside six spinning processes the 24 calls took 6-8 s after the
	// gate, each on the 10/s grid, departures missed by owners woken
	// late): the 40 s above is its liveness bound.
	if len(api.calls) > 1 {
		if first := api.calls[1].at.Sub(gate); first > 1500*time.Millisecond {
			t.Errorf("first call after the pause %v after the gate: the pause held the workers longer than the API asked", first)
		}
	}
}

// 100 tasks enqueued paced at 20/s under the workers' rule, on a real
// redis-server and asynq: each runs once, and on the Redis clock the rule
// never starts more than limit + burst in a second. That a task runs on
// its receipt at its slot is asserted exactly on virtual time
// (worker.TestAsynqPacedBatchRunsOnItsReceipts); here, where a loaded
// machine may bring a task to a worker later than its receipt allows (it
// then takes a new turn), how many did and how late they started is
// logged, not asserted.
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

	type start struct {
		at   time.Time
		wait admission.Wait
	}
	var mu sync.Mutex
	var runs atomic.Int64
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
			runs.Add(1)
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
	select {
	case <-allDone:
	case <-time.After(time.Minute): // liveness only: 5 s of slots
		t.Fatal("the tasks did not finish within a minute")
	}

	mu.Lock()
	defer mu.Unlock()
	if len(starts) != tasks || runs.Load() != tasks {
		t.Fatalf("%d runs of %d distinct tasks, want each of the %d once", runs.Load(), len(starts), tasks)
	}
	turns := make([]time.Time, 0, tasks)
	var redeemed int
	var maxLate time.Duration
	for i := range tasks {
		s := starts[i]
		turns = append(turns, s.wait.Turn)
		if s.wait.Redeemed {
			redeemed++
		}
		maxLate = max(maxLate, s.at.Sub(slots[i]))
	}
	if most := redistest.MaxInWindow(turns, time.Second); most > 21 {
		t.Errorf("%d turns in one second on the Redis clock, want at most limit + burst = 21", most)
	}
	t.Logf("%d tasks: %d ran on a booked turn; latest start %v after its slot", tasks, redeemed, maxLate.Round(time.Millisecond))
}
