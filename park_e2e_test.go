package jobthrottle_test

// End-to-end tests of parking (issue 9): real asynq servers and client, a
// real redis-server, the worker middleware with wake-ups. Each asserts the
// counts a team would watch: every task once, parks and limiter calls per
// task, the most turns in any second on the Redis clock, and how long a
// cold subject waits behind a hot one.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// parkFleet is asynq servers on one Redis whose middleware parks tasks.
// Limiters talk to Redis through their own clients, so that their script
// calls can be counted apart from asynq's.
type parkFleet struct {
	t      *testing.T
	proc   *redistest.Proc
	client *asynq.Client
	insp   *asynq.Inspector
	prefix string
	calls  redistest.ScriptCalls  // limiter script calls (EVALSHA/EVAL)
	ledger *redistest.LedgerCalls // if set, counts the wake-up ledger's calls of every server

	mu       sync.Mutex
	enqueued map[string]time.Time // task ID → when it was enqueued
	starts   []taskStart
	parks    int     // handler errors that parked a task
	errs     []error // other handler errors
}

type taskStart struct {
	id, subject string
	tenant      string    // the payload's tenant
	at          time.Time // handler start, local clock
	wait        admission.Wait
}

func newParkFleet(t *testing.T) *parkFleet {
	t.Helper()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	return &parkFleet{t: t, proc: proc, client: asynq.NewClientFromRedisClient(rdb),
		insp: asynq.NewInspectorFromRedisClient(rdb), prefix: redistest.Prefix(t), enqueued: map[string]time.Time{}}
}

// server starts one asynq server (a worker process) with one rule over
// "job:*", subject from the payload's "tenant", and returns a func that
// shuts it down (also run at cleanup).
func (f *parkFleet) server(concurrency int, rule throttle.Rule, maxWait time.Duration) func() {
	f.t.Helper()
	rdb := f.proc.Client(f.t)
	if f.ledger != nil {
		rdb.AddHook(f.ledger)
	}
	limRDB := f.proc.Client(f.t)
	f.calls.Count(limRDB)
	lim, err := throttle.New(limRDB, throttle.Options{Prefix: f.prefix}, rule)
	if err != nil {
		f.t.Fatal(err)
	}
	mw, err := worker.NewMiddleware([]worker.TaskRule{{Name: rule.Name, Tasks: []string{"job:*"}, Limiter: lim,
		Subject: worker.PayloadField("tenant"), Settings: admission.Settings{MaxWait: maxWait}}}, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		f.t.Fatal(err)
	}
	return f.serve(rdb, concurrency, mw)
}

// serve starts one asynq server on rdb whose handler, behind mw, records
// each start; it returns a func that shuts it down (also run at cleanup).
func (f *parkFleet) serve(rdb redis.UniversalClient, concurrency int, mw *worker.Middleware) func() {
	f.t.Helper()
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("job:", func(ctx context.Context, task *asynq.Task) error {
		w, _ := admission.WaitedFrom(ctx)
		id, _ := asynq.GetTaskID(ctx)
		var p struct{ Tenant string }
		_ = json.Unmarshal(task.Payload(), &p)
		f.mu.Lock()
		defer f.mu.Unlock()
		f.starts = append(f.starts, taskStart{id: id, subject: w.Subject, tenant: p.Tenant, at: time.Now(), wait: w})
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency: concurrency,
		LogLevel:    asynq.FatalLevel,
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			f.mu.Lock()
			defer f.mu.Unlock()
			if errors.Is(err, worker.ErrParked) {
				f.parks++
			} else {
				f.errs = append(f.errs, err)
			}
		}),
	}))
	if err := srv.Start(mux); err != nil {
		f.t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(func() { srv.Shutdown(); mw.Drain() }) }
	f.t.Cleanup(stop)
	return stop
}

// fromRules starts n asynq servers of 20 slots, each with a middleware
// built from a rules file of one rule "api" over "job:*", subject the fixed
// key-1, gcra per second with burst 1, and the given fields (at least
// limit), its limiter calls counted.
func (f *parkFleet) fromRules(n int, fields string) {
	f.t.Helper()
	cfg, err := rules.Parse("rules.yaml", fmt.Appendf(nil, `prefix: %q
rules:
  - name: api
    tasks: ["job:*"]
    subject: {fixed: key-1}
    algorithm: gcra
    period: 1s
    burst: 1%s
`, f.prefix, fields))
	if err != nil {
		f.t.Fatal(err)
	}
	for range n {
		rdb := f.proc.Client(f.t)
		limRDB := f.proc.Client(f.t)
		f.calls.Count(limRDB)
		mw, err := worker.FromRules(cfg, limRDB, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			f.t.Fatal(err)
		}
		f.serve(rdb, 20, mw)
	}
}

// enqueue enqueues n tasks of tenant at once.
func (f *parkFleet) enqueue(tenant string, n int) { f.enqueueType("job:call", tenant, n) }

// enqueueType enqueues n tasks of a type and tenant at once.
func (f *parkFleet) enqueueType(taskType, tenant string, n int) {
	f.t.Helper()
	for range n {
		info, err := f.client.Enqueue(asynq.NewTask(taskType, fmt.Appendf(nil, `{"tenant":%q}`, tenant)), asynq.Retention(time.Hour))
		if err != nil {
			f.t.Fatal(err)
		}
		f.mu.Lock()
		f.enqueued[info.ID] = time.Now()
		f.mu.Unlock()
	}
}

// wait waits until n tasks have started, and returns the starts.
func (f *parkFleet) wait(n int, timeout time.Duration) []taskStart {
	f.t.Helper()
	for end := time.Now().Add(timeout); ; time.Sleep(20 * time.Millisecond) {
		f.mu.Lock()
		got := slices.Clone(f.starts)
		f.mu.Unlock()
		if len(got) >= n {
			return got
		}
		if time.Now().After(end) {
			f.t.Fatalf("%d of %d tasks started within %v", len(got), n, timeout)
		}
	}
}

// check asserts that every enqueued task started exactly once, that no
// handler failed, and that the queue shows no failure.
func (f *parkFleet) check(starts []taskStart) {
	f.t.Helper()
	seen := map[string]int{}
	for _, s := range starts {
		seen[s.id]++
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for id := range f.enqueued {
		if seen[id] != 1 {
			f.t.Errorf("task %s started %d times, want once", id, seen[id])
		}
	}
	if len(seen) != len(f.enqueued) {
		f.t.Errorf("%d distinct tasks started, %d enqueued", len(seen), len(f.enqueued))
	}
	if len(f.errs) > 0 {
		f.t.Errorf("%d handler errors other than parking, first: %v", len(f.errs), f.errs[0])
	}
	q, err := f.insp.GetQueueInfo("default")
	if err != nil {
		f.t.Fatal(err)
	}
	if q.FailedTotal != 0 || q.Archived != 0 {
		f.t.Errorf("inspector: %d failed, %d archived; want none", q.FailedTotal, q.Archived)
	}
}

// maxTurnsPerWindow returns the most turns (on the Redis clock) of subject
// in any window of length d.
func maxTurnsPerWindow(starts []taskStart, subject string, d time.Duration) int {
	var turns []time.Time
	for _, s := range starts {
		if s.subject == subject {
			turns = append(turns, s.wait.Turn)
		}
	}
	return redistest.MaxInWindow(turns, d)
}

// backlog runs n tasks of tenant "acme" enqueued at once on three worker
// processes of concurrency 10 under a GCRA rule of rate per second (burst
// 1, MaxWait 200ms), checks that each ran once, and returns the starts and
// how long they took.
func (f *parkFleet) backlog(n, rate int, timeout time.Duration) ([]taskStart, time.Duration) {
	f.t.Helper()
	rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)}
	for range 3 {
		f.server(10, rule, 200*time.Millisecond)
	}
	start := time.Now()
	f.enqueue("acme", n)
	starts := f.wait(n, timeout)
	took := time.Since(start)
	f.check(starts)
	return starts, took
}

// TestParkBacklog: 300 tasks of one tenant enqueued at once, three worker
// processes of concurrency 10, a 20/s rule: the backlog drains at the
// limit, each task parked about once, about two limiter calls per task,
// never more than limit + burst turns in any second on the Redis clock.
func TestParkBacklog(t *testing.T) {
	t.Parallel()
	const n, rate = 300, 20
	f := newParkFleet(t)
	starts, took := f.backlog(n, rate, 60*time.Second)

	// The targets (N/R × 1.02 + 2 s, ≤ 2.05 limiter calls and
	// ≤ 1.05 parks per task) are measured by the bench (bench -backlog,
	// BENCHMARKS.md); here, under -race on a shared machine, a late
	// return costs a new turn now and then, so the bounds leave room for
	// a few: what they catch is a design that spins (25 per task before).
	// The bounds are loose enough for a machine with two spinning
	// processes per core beside the test (20.2 s, 1.17 parks and 2.17
	// calls per task there) and still tell a spinning design, or one
	// that drains at half the limit, from this one.
	want := time.Duration(n-1) * time.Second / rate
	if limit := want*3/2 + 3*time.Second; took > limit {
		t.Errorf("the backlog took %v, want at most %v (N/R × 1.5 + 3s)", took, limit)
	}
	if most := maxTurnsPerWindow(starts, "acme", time.Second); most > rate+1 {
		t.Errorf("%d turns in one second on the Redis clock, want at most %d (limit + burst)", most, rate+1)
	}
	f.mu.Lock()
	parks := f.parks
	f.mu.Unlock()
	calls := f.calls.Load()
	if per := float64(parks) / n; per > 1.5 {
		t.Errorf("%.3f parks per task, want at most 1.5", per)
	}
	if per := float64(calls) / n; per > 2.5 {
		t.Errorf("%.3f limiter calls per task, want at most 2.5", per)
	}
	t.Logf("%d tasks in %v (ideal %v): %.3f parks and %.3f limiter calls per task; at most %d turns in a second",
		n, took.Round(time.Millisecond), want, float64(parks)/n, float64(calls)/n, maxTurnsPerWindow(starts, "acme", time.Second))
}

// TestParkHotAndCold: hot tasks of one tenant (100 at 10/s, or 1000 at
// 50/s, whose turns are then closer together than any worker waits), then
// 10 of a cold one, in one queue, one worker of concurrency 10 and a
// max_wait of 30s: the hot tasks park instead of holding the worker slots,
// so the cold ones start within seconds of being enqueued, not behind the
// hot backlog; the hot tenant runs
// no faster than its limit (how close to it: the bench).
func TestParkHotAndCold(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ hot, rate int }{{100, 10}, {1000, 50}} {
		t.Run(fmt.Sprintf("%d at %d per second", tc.hot, tc.rate), func(t *testing.T) {
			t.Parallel()
			f := newParkFleet(t)
			rule := throttle.Rule{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(tc.rate).WithBurst(1)}
			f.server(10, rule, 30*time.Second)
			f.enqueue("hot", tc.hot)
			f.enqueue("cold", 10)
			starts := f.wait(tc.hot+10, 90*time.Second)
			f.check(starts)

			var coldWorst time.Duration
			var hotTurns []time.Time
			f.mu.Lock()
			for _, s := range starts {
				switch s.subject {
				case "cold":
					coldWorst = max(coldWorst, s.at.Sub(f.enqueued[s.id]))
				case "hot":
					hotTurns = append(hotTurns, s.wait.Turn)
				}
			}
			f.mu.Unlock()
			// Behind the hot backlog a cold task would wait 10 to 20 s;
			// parked, it waits for a worker's pick-up and a wake-up
			// (0.4 to 1.1 s on a quiet machine, 2.6 s seen on a loaded
			// one): 5 s tells the two apart whatever the load.
			if coldWorst > 5*time.Second {
				t.Errorf("a cold task started %v after it was enqueued, want at most 5s", coldWorst)
			}
			slices.SortFunc(hotTurns, time.Time.Compare)
			span := hotTurns[len(hotTurns)-1].Sub(hotTurns[0])
			// How close to its limit the hot tenant runs is the bench's
			// claim (98 %, BENCHMARKS.md, on a quiet machine): here a
			// loaded machine's late returns lose turns (93 % under -race
			// beside other builds), so only the bound is asserted.
			rate := float64(len(hotTurns)-1) / span.Seconds()
			if rate > float64(tc.rate)*1.0001 {
				t.Errorf("the hot tenant ran at %.2f/s on the Redis clock, over its limit of %d/s", rate, tc.rate)
			}
			if most := maxTurnsPerWindow(starts, "hot", time.Second); most > tc.rate+1 {
				t.Errorf("%d hot turns in one second, want at most %d", most, tc.rate+1)
			}
			t.Logf("cold tasks: worst %v from enqueue to start; hot: %d tasks over %v of turns (%.1f%% of its limit)", coldWorst.Round(time.Millisecond), tc.hot, span.Round(time.Millisecond), 100*rate/float64(tc.rate))
		})
	}
}

// TestParkFleetDownAndBack: 60 tasks at 10/s; the whole fleet stops after
// about 2s, with most tasks parked on booked turns, and is back 4s later.
// The turns that passed meanwhile are stale: those tasks take new turns
// instead of running at once, so no second, before or after, has more
// than limit + burst turns on the Redis clock, or more than one extra
// start on the local clock; every task runs once.
func TestParkFleetDownAndBack(t *testing.T) {
	t.Parallel()
	const n, rate = 60, 10
	f := newParkFleet(t)
	rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)}
	stops := []func(){f.server(5, rule, 100*time.Millisecond), f.server(5, rule, 100*time.Millisecond)}
	f.enqueue("acme", n)
	time.Sleep(2 * time.Second)
	for _, stop := range stops {
		stop()
	}
	f.mu.Lock()
	before := len(f.starts)
	f.mu.Unlock()
	time.Sleep(4 * time.Second)
	back := time.Now()
	f.server(5, rule, 100*time.Millisecond)
	f.server(5, rule, 100*time.Millisecond)
	starts := f.wait(n, 60*time.Second)
	f.check(starts)

	if before < 10 || before > 30 {
		t.Errorf("%d tasks started before the stop, want about 20", before)
	}
	if most := maxTurnsPerWindow(starts, "acme", time.Second); most > rate+1 {
		t.Errorf("%d turns in one second on the Redis clock, want at most %d", most, rate+1)
	}
	var after []time.Time
	for _, s := range starts {
		if s.at.After(back) {
			after = append(after, s.at)
		}
	}
	if most := redistest.MaxInWindow(after, time.Second); most > rate+2 {
		t.Errorf("%d tasks started in one second after the fleet came back, want at most %d", most, rate+2)
	}
	t.Logf("%d started before the stop, %d after; at most %d turns and %d starts in a second after",
		before, len(after), maxTurnsPerWindow(starts, "acme", time.Second), redistest.MaxInWindow(after, time.Second))
}

// TestParkSharedBudget: two task types of two rules draw on one budget of
// the rules file (20/s); 100 of each enqueued at once on two workers. Their
// turns together never pass the budget in any second on the Redis clock,
// and the 200 take the budget's 10s, not the 5s two separate limits would.
func TestParkSharedBudget(t *testing.T) {
	t.Parallel()
	f := newParkFleet(t)
	cfg, err := rules.Parse("rules.yaml", fmt.Appendf(nil, `prefix: %q
budgets:
  - {name: smtp, algorithm: gcra, limit: 20, period: 1s, burst: 1}
rules:
  - name: send
    tasks: ["job:send"]
    subject: {fixed: relay}
    budget: smtp
  - name: digest
    tasks: ["job:digest"]
    subject: {fixed: relay}
    budget: smtp
`, f.prefix))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		rdb := f.proc.Client(t)
		mw, err := worker.FromRules(cfg, rdb, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		f.serve(rdb, 10, mw)
	}
	f.enqueueType("job:send", "a", 100)
	f.enqueueType("job:digest", "a", 100)
	starts := f.wait(200, 60*time.Second)
	f.check(starts)
	var turns []time.Time
	for _, s := range starts {
		turns = append(turns, s.wait.Turn)
	}
	if most := redistest.MaxInWindow(turns, time.Second); most > 21 {
		t.Errorf("%d turns of the two types in one second on the Redis clock, want at most 21 (the budget + burst)", most)
	}
	slices.SortFunc(turns, time.Time.Compare)
	if span := turns[len(turns)-1].Sub(turns[0]); span < 199*time.Second/20-time.Millisecond {
		t.Errorf("200 turns span %v, want the budget's 9.95s", span)
	}
}

// TestParkWithoutWakeups: a middleware without Options.Asynq has no wake-up
// ledger; a parked task is scheduled for the whole second before its turn
// (asynq's resolution) and waits out the rest in its slot. 60 tasks at
// 10/s on two workers: the turns keep the limit and no task spins.
func TestParkWithoutWakeups(t *testing.T) {
	t.Parallel()
	const n, rate = 60, 10
	f := newParkFleet(t)
	rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)}
	for range 2 {
		rdb := f.proc.Client(t)
		lim, err := throttle.New(rdb, throttle.Options{Prefix: f.prefix}, rule)
		if err != nil {
			t.Fatal(err)
		}
		mw, err := worker.NewMiddleware([]worker.TaskRule{{Name: "api", Tasks: []string{"job:*"}, Limiter: lim,
			Subject: worker.PayloadField("tenant"), Settings: admission.Settings{MaxWait: 200 * time.Millisecond, WaitSlots: 2}}}, worker.Options{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		f.serve(rdb, 10, mw)
	}
	start := time.Now()
	f.enqueue("acme", n)
	starts := f.wait(n, 60*time.Second)
	took := time.Since(start)
	f.check(starts)
	if most := maxTurnsPerWindow(starts, "acme", time.Second); most > rate+1 {
		t.Errorf("%d turns in one second on the Redis clock, want at most %d", most, rate+1)
	}
	f.mu.Lock()
	parks := f.parks
	f.mu.Unlock()
	// Whole-second scheduling is the fallback: a task brought back late
	// takes a new turn more often than with wake-ups; it must not spin.
	if per := float64(parks) / n; per > 1.5 {
		t.Errorf("%.3f parks per task, want at most 1.5", per)
	}
	if want := time.Duration(n-1) * time.Second / rate; took > want+3*time.Second {
		t.Errorf("%d tasks took %v, want at most %v + 3s", n, took, want)
	}
	t.Logf("without wake-ups: %d tasks in %v, %.3f parks per task", n, took.Round(time.Millisecond), float64(parks)/n)
}

// TestParkFairShares: one API key of 100/s shared by every tenant
// (fair_by: tenant), three workers. Tenant A's 5,000 tasks are enqueued
// first and all wait in the key's line; then B and C enqueue 100 each.
// From 2s after they are enqueued until they are done, B and C each take
// at least 28 % of the key's turns (a third each, less A's turns booked
// ahead; A the rest), and the key
// never passes 100/s +
// burst in any second on the Redis clock. The test ends once B's and C's
// tasks have run; A's backlog is left to the cleanup.
func TestParkFairShares(t *testing.T) {
	t.Parallel()
	const rate = 100
	f := newParkFleet(t)
	f.fromRules(3, fmt.Sprintf(`
    fair_by: {payload_field: tenant}
    limit: %d`, rate))
	f.enqueue("A", 5000)
	// A's tasks have all been through a worker once: each has run, or
	// parked on a booked turn or in the line.
	for end := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		f.mu.Lock()
		seen := f.parks + len(f.starts)
		f.mu.Unlock()
		if seen >= 5000 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("A's 5000 tasks not parked within 60s: %d parks and starts", seen)
		}
	}
	joined := time.Now()
	f.enqueue("B", 100)
	f.enqueue("C", 100)
	var starts []taskStart
	for end := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		f.mu.Lock()
		starts = slices.Clone(f.starts)
		f.mu.Unlock()
		done := map[string]int{}
		for _, s := range starts {
			done[s.tenant]++
		}
		if done["B"] == 100 && done["C"] == 100 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("B and C not done within 60s: %v", done)
		}
	}
	from := joined.Add(2 * time.Second)
	var all []time.Time
	first, last, n := map[string]time.Time{}, map[string]time.Time{}, map[string]int{}
	for _, s := range starts {
		all = append(all, s.wait.Turn)
		who, turn := s.tenant, s.wait.Turn
		if turn.Before(from) {
			continue
		}
		n[who]++
		if first[who].IsZero() || turn.Before(first[who]) {
			first[who] = turn
		}
		if turn.After(last[who]) {
			last[who] = turn
		}
	}
	// Each share is counted against the key's turns in the same span, not
	// against 100/s: a loaded machine takes the key's turns late for every
	// tenant alike (at load 11 on 2 cores the key ran at 84/s), and what
	// fair_by promises is the division. The span is each tenant's own, up
	// to its last turn: one that got ahead before the span began finishes
	// first, and the turns after it are no longer its to take. Turns on
	// the Redis clock, not handler starts, which a loaded machine
	// delays unevenly (C 26.3 % by starts beside two spinners a core).
	for _, who := range []string{"B", "C"} {
		inSpan := 0
		for _, s := range starts {
			if !s.wait.Turn.Before(from) && !s.wait.Turn.After(last[who]) {
				inSpan++
			}
		}
		if n[who] < 10 || inSpan == 0 {
			t.Errorf("tenant %s: %d tasks from 2s after enqueue; want its share", who, n[who])
			continue
		}
		if share := float64(n[who]) / float64(inSpan); share < 0.28 {
			t.Errorf("tenant %s took %.1f%% of the key's %d turns from 2s after it was enqueued until it was done, want at least 28%% (a third, less A's turns booked ahead)", who, 100*share, inSpan)
		}
	}
	if most := redistest.MaxInWindow(all, time.Second); most > rate+1 {
		t.Errorf("%d turns of the key in one second on the Redis clock, want at most %d", most, rate+1)
	}
	t.Logf("from 2s after B and C joined: B %d, C %d, A %d tasks; B done %v and C %v after joining; %d limiter calls for %d starts",
		n["B"], n["C"], n["A"], last["B"].Sub(joined).Round(time.Millisecond), last["C"].Sub(joined).Round(time.Millisecond), f.calls.Load(), len(starts))
}

// TestParkLiveChange: three workers drain a backlog of one subject under a
// 10/s rule; the rules file changes to 50/s, then to 5/s, and every worker
// reloads it (Middleware.Reload, as cmd/worker does on SIGHUP). The turns
// booked under the old limit are kept (at most the 1s horizon of them),
// new ones use the new limit: on the Redis clock, from one second after
// each change the turns come at the new rate and no second passes the new
// limit + burst; no second at all passes the old one's.
func TestParkLiveChange(t *testing.T) {
	t.Parallel()
	f := newParkFleet(t)
	cfgAt := func(rate int) *rules.Config {
		cfg, err := rules.Parse("rules.yaml", fmt.Appendf(nil, `prefix: %q
rules:
  - name: api
    tasks: ["job:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: %d
    period: 1s
    burst: 1
`, f.prefix, rate))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	var mws []*worker.Middleware
	for range 3 {
		rdb := f.proc.Client(t)
		mw, err := worker.FromRules(cfgAt(10), rdb, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		f.serve(rdb, 20, mw)
		mws = append(mws, mw)
	}
	f.enqueue("acme", 400)
	change := func(rate int) time.Time {
		cfg := cfgAt(rate)
		for _, mw := range mws {
			if err := mw.Reload(cfg); err != nil {
				t.Fatal(err)
			}
		}
		return time.Now()
	}
	time.Sleep(4 * time.Second)
	to50 := change(50)
	time.Sleep(4 * time.Second)
	to5 := change(5)
	time.Sleep(4 * time.Second)
	f.mu.Lock()
	starts := slices.Clone(f.starts)
	errs := slices.Clone(f.errs)
	f.mu.Unlock()
	if len(errs) > 0 {
		t.Errorf("%d handler errors other than parking, first: %v", len(errs), errs[0])
	}
	phase := func(from, to time.Time) []time.Time {
		var turns []time.Time
		for _, s := range starts {
			if !s.wait.Turn.Before(from) && s.wait.Turn.Before(to) {
				turns = append(turns, s.wait.Turn)
			}
		}
		slices.SortFunc(turns, time.Time.Compare)
		return turns
	}
	rateOf := func(turns []time.Time) float64 {
		if len(turns) < 2 {
			return 0
		}
		return float64(len(turns)-1) / turns[len(turns)-1].Sub(turns[0]).Seconds()
	}
	end := to5.Add(4 * time.Second)
	for _, p := range []struct {
		name        string
		from, to    time.Time
		most, least int     // the limit + burst in force; see least below
		hi, rate    float64 // the rate from one second after the change
	}{
		// hi: the rate plus 0.5 %, a few ms over a phase of seconds: a
		// turn redeemed late, within the tolerance, is reported at its
		// redemption (throttle's Admission.Slot: now + a delay of 0), not
		// at its booked slot, so a phase whose first turn came late looks
		// shorter (a -race run: 50.11/s, never more than 51 in any second;
		// most, limit + burst in any second, stays exact).
		// least: how many turns some second of the phase must hold, more
		// than the other phases' limits allow (10/s above 5/s's 6, 50/s
		// above 10/s's 11): what shows that the reload took effect. Not
		// the rate: turns are booked when workers ask, and on a loaded
		// machine they ask late (a run at load 14 saw 4.75/s in the 10/s
		// phase, which includes the workers' start), while the turns a
		// parked backlog books ahead come at the limit's spacing.
		{"10/s", time.Time{}, to50, 11, 7, 10.05, 10},
		{"50/s", to50, to5, 51, 12, 50.25, 50},
		{"5/s", to5, end, 6, 0, 5.025, 5},
	} {
		// Within a second of a change, the turns booked under the old limit
		// (a horizon's worth) still come; the old limit holds for them,
		// and the new one from then on.
		all := phase(p.from, p.to)
		settled := all
		if !p.from.IsZero() {
			settled = phase(p.from.Add(time.Second), p.to)
		}
		if most := redistest.MaxInWindow(settled, time.Second); most > p.most {
			t.Errorf("%s: %d turns in one second on the Redis clock, want at most %d", p.name, most, p.most)
		}
		if most := redistest.MaxInWindow(all, time.Second); most > 51 {
			t.Errorf("%s: %d turns in one second, counting those booked before the change; want at most 51", p.name, most)
		}
		if most := redistest.MaxInWindow(settled, time.Second); most < p.least {
			t.Errorf("%s: at most %d turns in one second from one second after the change; want %d or more, beyond the other phases' limits", p.name, most, p.least)
		}
		if r := rateOf(settled); r > p.hi {
			t.Errorf("%s: %.2f/s from one second after the change, want at most %v/s", p.name, r, p.rate)
		}
		t.Logf("%s: %d turns, %.2f/s and at most %d in a second from one second after the change", p.name, len(all), rateOf(settled), redistest.MaxInWindow(settled, time.Second))
	}
}

// TestParkShareLimits: one API key at 50/s shared by tenants (fair_by),
// each tenant also limited to 20/s of it (share_limit), three workers.
// Tenants A and B queue 200 tasks each at once: each runs at its own
// 20/s, not held to the key's fair half nor let past its limit; tenant C
// comes once each ran 40, with 40 tasks: it starts within 2s, and the three share
// the key. On the Redis clock no tenant passes 20/s and the key never
// passes 50/s in any second; every task runs once; the limiter calls stay
// a few per task.
func TestParkShareLimits(t *testing.T) {
	t.Parallel()
	f := newParkFleet(t)
	f.fromRules(3, `
    fair_by: {payload_field: tenant}
    share_limit: {limit: 20, period: 1s, burst: 1}
    limit: 50`)
	start := time.Now()
	f.enqueue("A", 200)
	f.enqueue("B", 200)
	// C comes once A and B have each run 40 tasks (2 s at their limit;
	// about 3 s after the start on an idle machine, later on a loaded
	// one, where enqueuing and parking A's 200 delays B's first turns).
	for end := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		n := map[string]int{}
		f.mu.Lock()
		for _, s := range f.starts {
			n[s.tenant]++
		}
		f.mu.Unlock()
		if n["A"] >= 40 && n["B"] >= 40 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("60 s after the start A ran %d tasks and B %d; want 40 each before C comes", n["A"], n["B"])
		}
	}
	joined := time.Now()
	f.enqueue("C", 40)
	var starts []taskStart
	for end := time.Now().Add(90 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		f.mu.Lock()
		starts = slices.Clone(f.starts)
		errs := slices.Clone(f.errs)
		f.mu.Unlock()
		if len(errs) > 0 {
			t.Fatalf("handler errors: %v", errs)
		}
		if len(starts) >= 440 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("%d of 440 tasks ran within 90s", len(starts))
		}
	}
	time.Sleep(300 * time.Millisecond) // a second run of any task would show
	f.mu.Lock()
	starts = slices.Clone(f.starts)
	f.mu.Unlock()
	seen := map[string]bool{}
	var all []time.Time
	turns := map[string][]time.Time{}
	first := map[string]time.Time{}
	for _, s := range starts {
		if seen[s.id] {
			t.Errorf("task %s ran twice", s.id)
		}
		seen[s.id] = true
		all = append(all, s.wait.Turn)
		turns[s.tenant] = append(turns[s.tenant], s.wait.Turn)
		if first[s.tenant].IsZero() || s.at.Before(first[s.tenant]) {
			first[s.tenant] = s.at
		}
	}
	if len(starts) != 440 {
		t.Errorf("%d starts for 440 tasks", len(starts))
	}
	if most := redistest.MaxInWindow(all, time.Second); most > 51 {
		t.Errorf("%d turns of the key in one second on the Redis clock, want at most 51", most)
	}
	for who, ts := range turns {
		if most := redistest.MaxInWindow(ts, time.Second); most > 21 {
			t.Errorf("tenant %s: %d turns in one second on the Redis clock, its limit is 20 (+1)", who, most)
		}
	}
	// A and B alone (before C came): each near its own 20/s. Shown by
	// the busiest second of its turns on the Redis clock, at least 15
	// (an idle machine: 20 or 21; load 12: 17): turns are booked when
	// workers ask, late on a loaded machine, but a parked backlog's
	// turns are booked back to back at the limit's spacing.
	for _, who := range []string{"A", "B"} {
		var before []time.Time
		for _, s := range starts {
			if s.tenant == who && s.wait.Turn.Before(joined) {
				before = append(before, s.wait.Turn)
			}
		}
		if most := redistest.MaxInWindow(before, time.Second); most < 15 {
			t.Errorf("tenant %s: at most %d turns in a second before C came, want near its limit of 20/s", who, most)
		}
	}
	if wait := first["C"].Sub(joined); wait > 2*time.Second {
		t.Errorf("tenant C started %v after it was enqueued, want within 2s", wait)
	}
	perTask := float64(f.calls.Load()) / float64(len(starts))
	if perTask > 4 {
		t.Errorf("%.2f limiter calls per task, want at most 4", perTask)
	}
	t.Logf("440 tasks in %v; C's first after %v; %.2f limiter calls per task", time.Since(start).Round(time.Millisecond), first["C"].Sub(joined).Round(time.Millisecond), perTask)
}
