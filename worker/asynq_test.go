package worker

// Tests against a real asynq server and client on a real redis-server:
// what asynq does with the middleware's answers. A test whose point is not
// time runs asynq on miniredis in a synctest bubble instead (bedOn).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// wakeSlack is how late a handler may start after its slot on a busy
// machine (timers and goroutines wake late, never early). Spacing checks
// allow it: it can only make a later start look closer to an earlier one.
const wakeSlack = 60 * time.Millisecond

// bed is a redis-server with an asynq client and inspector on it.
type bed struct {
	t      *testing.T
	proc   *redistest.Proc
	rdb    *redis.Client
	client *asynq.Client
	insp   *asynq.Inspector
	prefix string

	mu   sync.Mutex
	ran  []ran   // handler runs, in order
	errs []error // errors the server's ErrorHandler saw
}

type ran struct {
	id   string
	at   time.Time
	wait admission.Wait
}

func newBed(t *testing.T) *bed {
	t.Helper()
	proc := redistest.Server(t)
	b := bedOn(t, proc.Client(t))
	b.proc = proc
	return b
}

// bedOn is a bed on rdb: inside redistest.Virtual, a miniredis in the
// test's synctest bubble, where asynq's whole-second schedule and its
// polling take no real time. (Call the server's Shutdown before the
// bubble's function returns: Virtual closes rdb then.)
func bedOn(t *testing.T, rdb *redis.Client) *bed {
	t.Helper()
	return &bed{
		t: t, rdb: rdb,
		client: asynq.NewClientFromRedisClient(rdb),
		insp:   asynq.NewInspectorFromRedisClient(rdb),
		prefix: redistest.Prefix(t),
	}
}

// limiter returns a limiter with one rule on the bed's Redis.
func (b *bed) limiter(rules ...throttle.Rule) *throttle.Limiter {
	b.t.Helper()
	lim, err := throttle.New(b.rdb, throttle.Options{Prefix: b.prefix}, rules...)
	if err != nil {
		b.t.Fatal(err)
	}
	return lim
}

// serve starts an asynq server whose handler, behind mw (through a
// ServeMux), records each run. cfg goes through Configure; unset intervals
// are short.
func (b *bed) serve(mw *Middleware, cfg asynq.Config) *asynq.Server {
	b.t.Helper()
	return b.serveStacked(cfg, mw)
}

// serveStacked is serve with several middlewares, outermost first.
func (b *bed) serveStacked(cfg asynq.Config, mws ...*Middleware) *asynq.Server {
	b.t.Helper()
	if cfg.Concurrency == 0 {
		cfg.Concurrency = 4
	}
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = 50 * time.Millisecond
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = 100 * time.Millisecond
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 2 * time.Second
	}
	cfg.LogLevel = asynq.FatalLevel
	cfg.ErrorHandler = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
		b.mu.Lock()
		defer b.mu.Unlock()
		b.errs = append(b.errs, err)
	})
	srv := asynq.NewServerFromRedisClient(b.rdb, Configure(cfg))
	mux := asynq.NewServeMux()
	for _, mw := range mws {
		mux.Use(mw.Wrap)
	}
	handler := func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		w, _ := admission.WaitedFrom(ctx)
		b.mu.Lock()
		b.ran = append(b.ran, ran{id: id, at: time.Now(), wait: w})
		b.mu.Unlock()
		return nil
	}
	// asynq's ServeMux matches by prefix and takes no empty pattern.
	for _, p := range []string{"api", "other", "busy", "slow", "report", "fixed", "policy", "t", "a:", "b:"} {
		mux.HandleFunc(p, handler)
	}
	if err := srv.Start(mux); err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(srv.Shutdown)
	return srv
}

func (b *bed) enqueue(typ, payload string, opts ...asynq.Option) *asynq.TaskInfo {
	b.t.Helper()
	info, err := b.client.Enqueue(asynq.NewTask(typ, []byte(payload)), opts...)
	if err != nil {
		b.t.Fatal(err)
	}
	return info
}

func (b *bed) runs() []ran {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.ran)
}

func (b *bed) seenErrors() []error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.errs)
}

func (b *bed) info(id string) *asynq.TaskInfo {
	b.t.Helper()
	info, err := b.insp.GetTaskInfo("default", id)
	if err != nil {
		b.t.Fatalf("task %s: %v", id, err)
	}
	return info
}

// noFailures checks that asynq counted no failure and archived nothing.
func (b *bed) noFailures() {
	b.t.Helper()
	q, err := b.insp.GetQueueInfo("default")
	if err != nil {
		b.t.Fatal(err)
	}
	if q.Failed != 0 || q.FailedTotal != 0 || q.Archived != 0 {
		b.t.Errorf("queue: failed today %d, failed total %d, archived %d; want 0, 0, 0", q.Failed, q.FailedTotal, q.Archived)
	}
}

// eventually polls cond until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(timeout); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("after %v: still not %s", timeout, what)
		}
	}
}

func middleware(t *testing.T, rules []TaskRule, opts ...Options) *Middleware {
	t.Helper()
	mw, err := NewMiddleware(rules, quietOptions(opts))
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

func TestAsynqWaitsForSlots(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	m, _ := NewMetrics(prometheus.NewRegistry())
	lim := b.limiter(throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
	// Eight waiting slots for the subject: every task may wait in its
	// worker slot for a turn within MaxWait (with the default two, the
	// others would park).
	const n = 8
	mw := middleware(t, []TaskRule{{Name: "api", Tasks: []string{"api:*"}, Limiter: lim, Subject: PayloadField("acct"), Settings: admission.Settings{MaxWait: 10 * time.Second, WaitSlots: n}}}, Options{Metrics: m})
	b.serve(mw, asynq.Config{Concurrency: 8})

	for range n {
		b.enqueue("api:call", `{"acct": "a1"}`, asynq.MaxRetry(2))
	}
	b.enqueue("other:task", `not json: passes through`)
	eventually(t, 20*time.Second, "all tasks run", func() bool { return len(b.runs()) == n+1 })

	var at []time.Time
	for _, r := range b.runs() {
		if r.wait.Rule == "" {
			continue // the unthrottled task
		}
		if r.wait.Subject != "a1" {
			t.Errorf("Wait %+v, want subject a1", r.wait)
		}
		at = append(at, r.at)
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	if len(at) != n {
		t.Fatalf("%d throttled runs, want %d", len(at), n)
	}
	for i := 1; i < n; i++ {
		// One slot per 100ms, in order. A handler that starts late (a
		// busy machine) can only make later ones look early: some slack.
		if gap := at[i].Sub(at[0]); gap < time.Duration(i)*100*time.Millisecond-wakeSlack {
			t.Errorf("run %d came %v after the first; slots are 100ms apart", i, gap)
		}
	}
	if got := testutil.ToFloat64(m.decisions.WithLabelValues("api", admission.LabelWaited)) + testutil.ToFloat64(m.decisions.WithLabelValues("api", admission.LabelAdmitted)); got != n {
		t.Errorf("admitted + waited = %v, want %d", got, n)
	}
	if got := testutil.ToFloat64(m.decisions.WithLabelValues("api", admission.LabelDeferred)); got != 0 {
		t.Errorf("deferred = %v, want 0: every slot was within MaxWait", got)
	}
	b.noFailures()
}

// stubborn defers the first n tasks it sees, as a limiter whose slot keeps
// being taken by others would, then admits.
type stubborn struct {
	mu sync.Mutex
	n  int
}

func (s *stubborn) WaitN(ctx context.Context, subject string, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n > 0 {
		s.n--
		return &throttle.DelayError{Rule: "busy", RetryAfter: time.Millisecond}
	}
	return nil
}

func TestAsynqDeferralKeepsRetries(t *testing.T) {
	// Each deferral costs about a second: asynq schedules retries in whole
	// seconds, and RetryDelay rounds RetryAt up so as never to run early.
	// So the test runs on virtual time (asynq and miniredis in a synctest
	// bubble): the 50 seconds take none.
	const deferrals = 50 // the issue: "a task deferred 50 times still runs when its turn comes"
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		mw := middleware(t, []TaskRule{{Name: "busy", Tasks: []string{"busy"}, Limiter: &stubborn{n: deferrals}, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: time.Millisecond}}})
		srv := b.serve(mw, asynq.Config{})
		defer srv.Shutdown()
		task := b.enqueue("busy", "", asynq.MaxRetry(2), asynq.Retention(time.Hour))

		eventually(t, (2*deferrals+10)*time.Second, "the task run", func() bool { return len(b.runs()) == 1 })
		eventually(t, 5*time.Second, "the task completed", func() bool { return b.info(task.ID).State == asynq.TaskStateCompleted })

		var throttled int
		for _, err := range b.seenErrors() {
			var te *admission.ThrottledError
			if !errors.As(err, &te) {
				t.Errorf("unexpected error %v", err)
			}
			throttled++
		}
		if throttled != deferrals {
			t.Errorf("deferred %d times, want %d", throttled, deferrals)
		}
		info := b.info(task.ID)
		if info.Retried != 0 || info.MaxRetry != 2 {
			t.Errorf("after %d deferrals: retried %d of %d, want 0 of 2", deferrals, info.Retried, info.MaxRetry)
		}
		b.noFailures()
	})
}

func TestAsynqDeferredUntilRetryAt(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	lim := b.limiter(throttle.Rule{Name: "slow", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: 2500 * time.Millisecond, Burst: 1}})
	if res, err := lim.Allow(context.Background(), "acct"); err != nil || !res.Allowed {
		t.Fatalf("taking the only permit: %+v, %v", res, err)
	}
	mw := middleware(t, []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("acct"), Settings: admission.Settings{MaxWait: 100 * time.Millisecond}}})
	b.serve(mw, asynq.Config{})
	task := b.enqueue("slow", "", asynq.MaxRetry(1), asynq.Retention(time.Hour))

	var te *admission.ThrottledError
	eventually(t, 10*time.Second, "the task deferred", func() bool {
		errs := b.seenErrors()
		return len(errs) > 0 && errors.As(errs[0], &te)
	})
	if d := time.Until(te.RetryAt); d < time.Second || d > 2600*time.Millisecond {
		t.Errorf("RetryAt in %v, want the next slot, about 2.5s after the first admission", d)
	}
	eventually(t, 5*time.Second, "the task in the retry set", func() bool { return b.info(task.ID).State == asynq.TaskStateRetry })
	info := b.info(task.ID)
	if want := ceilSecond(te.RetryAt); !info.NextProcessAt.Equal(want) {
		t.Errorf("scheduled for %v, want RetryAt %v rounded up to %v", info.NextProcessAt, te.RetryAt, want)
	}
	if info.Retried != 0 || info.LastErr != te.Error() {
		t.Errorf("retried %d, last error %q; want 0 and %q", info.Retried, info.LastErr, te.Error())
	}

	eventually(t, 10*time.Second, "the task run", func() bool { return len(b.runs()) == 1 })
	r := b.runs()[0]
	if r.at.Before(te.RetryAt) {
		t.Errorf("ran %v before RetryAt", te.RetryAt.Sub(r.at))
	}
	if late := r.at.Sub(ceilSecond(te.RetryAt)); late > 1500*time.Millisecond {
		t.Errorf("ran %v after its scheduled second", late)
	}
	eventually(t, 5*time.Second, "the task completed", func() bool { return b.info(task.ID).State == asynq.TaskStateCompleted })
	if info := b.info(task.ID); info.Retried != 0 {
		t.Errorf("retried %d, want 0", info.Retried)
	}
	b.noFailures()
}

func TestAsynqMalformedPayloadArchivedOnce(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	m, _ := NewMetrics(prometheus.NewRegistry())
	lim := b.limiter(throttle.Rule{Name: "r", Algorithm: throttle.TokenBucket, Limit: throttle.PerSecond(100)})
	mw := middleware(t, []TaskRule{{Name: "tenant", Tasks: []string{"report:*"}, Limiter: lim, Subject: PayloadField("tenant")}}, Options{Metrics: m})
	b.serve(mw, asynq.Config{})
	bad := b.enqueue("report:build", `{"tenant": `, asynq.MaxRetry(5))
	missing := b.enqueue("report:build", `{"other": "x"}`, asynq.MaxRetry(5))

	for _, id := range []string{bad.ID, missing.ID} {
		eventually(t, 10*time.Second, "the task archived", func() bool { return b.info(id).State == asynq.TaskStateArchived })
	}
	if info := b.info(bad.ID); info.Retried != 0 || info.LastErr != `worker: rule "tenant": task `+bad.ID+` (report:build): cannot derive the subject: payload is not a JSON object, so it has no field "tenant"; archived without retry` {
		t.Errorf("retried %d, last error %q", info.Retried, info.LastErr)
	}
	if info := b.info(missing.ID); info.Retried != 0 || info.LastErr != `worker: rule "tenant": task `+missing.ID+` (report:build): cannot derive the subject: payload has no field "tenant"; archived without retry` {
		t.Errorf("retried %d, last error %q", info.Retried, info.LastErr)
	}
	if n := len(b.runs()); n != 0 {
		t.Errorf("the handler ran %d times", n)
	}
	if n := len(b.seenErrors()); n != 2 {
		t.Errorf("%d errors, want 2: each task tried once", n)
	}
	if got := testutil.ToFloat64(m.decisions.WithLabelValues("tenant", admission.LabelError)); got != 2 {
		t.Errorf("decisions{outcome=error} = %v, want 2", got)
	}
}

func TestAsynqWindowRules(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	fixed := b.limiter(throttle.Rule{Name: "fw", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 3, Period: time.Second}})
	policy := b.limiter(
		throttle.Rule{Name: "sw", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 3, Period: time.Second}, Precision: 50 * time.Millisecond},
		throttle.Rule{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20)},
	)
	mw := middleware(t, []TaskRule{
		{Name: "fixed", Tasks: []string{"fixed"}, Limiter: fixed, Subject: Fixed("t"), Settings: admission.Settings{MaxWait: 300 * time.Millisecond}},
		{Name: "policy", Tasks: []string{"policy"}, Limiter: policy, Subject: Fixed("t"), Settings: admission.Settings{MaxWait: 300 * time.Millisecond}},
	})
	b.serve(mw, asynq.Config{Concurrency: 10})
	const each = 7
	ids := map[string]string{}
	for range each {
		for _, typ := range []string{"fixed", "policy"} {
			ids[b.enqueue(typ, "", asynq.MaxRetry(1), asynq.Retention(time.Hour)).ID] = typ
		}
	}
	eventually(t, 30*time.Second, "every task run", func() bool { return len(b.runs()) == 2*each })

	byRule := map[string][]time.Time{}
	for _, r := range b.runs() {
		byRule[r.wait.Rule] = append(byRule[r.wait.Rule], r.at)
	}
	for rule, at := range byRule {
		slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
		if len(at) != each {
			t.Errorf("rule %s: %d runs, want %d", rule, len(at), each)
		}
		if rule == "policy" {
			// The sliding window never admits more than 3 in a second.
			for i := 3; i < len(at); i++ {
				if gap := at[i].Sub(at[i-3]); gap < time.Second-wakeSlack {
					t.Errorf("policy: runs %d and %d only %v apart: 4 in one second", i-3, i, gap)
				}
			}
		}
	}
	var deferred int
	for _, err := range b.seenErrors() {
		var te *admission.ThrottledError
		if !errors.As(err, &te) {
			t.Errorf("unexpected error %v", err)
		}
		deferred++
	}
	if deferred == 0 {
		t.Error("no task was deferred, though 7 tasks at 3/s cannot all start within 300ms")
	}
	for id := range ids {
		if info := b.info(id); info.Retried != 0 || info.State != asynq.TaskStateCompleted {
			t.Errorf("task %s (%s): %v, retried %d; want completed, 0", id, ids[id], info.State, info.Retried)
		}
	}
	b.noFailures()
}

// slowLimiter returns a limiter whose next slot is d away, with the one
// permit before it taken.
func (b *bed) slowLimiter(d time.Duration, subject string) *throttle.Limiter {
	b.t.Helper()
	lim := b.limiter(throttle.Rule{Name: "slow", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: d, Burst: 1}})
	if res, err := lim.Allow(context.Background(), subject); err != nil || !res.Allowed {
		b.t.Fatalf("taking the only permit: %+v, %v", res, err)
	}
	return lim
}

func TestAsynqShutdownWhileWaiting(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	m, _ := NewMetrics(prometheus.NewRegistry())
	lim := b.slowLimiter(20*time.Second, "s")
	mw := middleware(t, []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: time.Minute}}}, Options{Metrics: m})
	srv := b.serve(mw, asynq.Config{ShutdownTimeout: 500 * time.Millisecond})
	task := b.enqueue("slow", "", asynq.MaxRetry(3))
	// The waiting task books the slot 20s ahead; the next is then 40s.
	// (The waiters gauge goes up just before that booking, so it is the
	// booking that is waited for.)
	eventually(t, 10*time.Second, "the task waiting on the slot 20s ahead", func() bool {
		res, err := lim.Allow(context.Background(), "s")
		return err == nil && res.RetryAfter >= 35*time.Second
	})
	if got := testutil.ToFloat64(m.waiters.WithLabelValues("slow")); got != 1 {
		t.Fatalf("waiters = %v while the task waits, want 1", got)
	}
	srv.Shutdown()

	// asynq put the task back in its queue, untouched.
	info := b.info(task.ID)
	if info.State != asynq.TaskStatePending || info.Retried != 0 {
		t.Errorf("after shutdown: %v, retried %d; want pending, 0", info.State, info.Retried)
	}
	// And the middleware refunded the slot.
	eventually(t, 5*time.Second, "the slot refunded", func() bool {
		res, err := lim.Allow(context.Background(), "s")
		return err == nil && res.RetryAfter < 21*time.Second
	})
	// The decision is counted after the refund's call returns: a check
	// right after the slot came back raced it (1 failure in 5 runs).
	eventually(t, 5*time.Second, "decisions{outcome=refunded} = 1", func() bool {
		return testutil.ToFloat64(m.decisions.WithLabelValues("slow", admission.LabelRefunded)) == 1
	})
	if len(b.runs()) != 0 {
		t.Error("the handler ran")
	}
	b.noFailures()
}

func TestAsynqDrain(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	m, _ := NewMetrics(prometheus.NewRegistry())
	lim := b.slowLimiter(20*time.Second, "s")
	mw := middleware(t, []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: time.Minute}}}, Options{Metrics: m})
	srv := b.serve(mw, asynq.Config{ShutdownTimeout: 30 * time.Second})
	task := b.enqueue("slow", "", asynq.MaxRetry(3))
	eventually(t, 10*time.Second, "the task waiting", func() bool { return testutil.ToFloat64(m.waiters.WithLabelValues("slow")) == 1 })

	start := time.Now()
	srv.Stop()
	mw.Drain()
	srv.Shutdown()
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("shutdown took %v; Drain should have freed the waiting worker at once", d)
	}
	info := b.info(task.ID)
	if info.State != asynq.TaskStateRetry || info.Retried != 0 {
		t.Errorf("after drain: %v, retried %d; want retry (for another worker), 0", info.State, info.Retried)
	}
	if d := time.Until(info.NextProcessAt); d > 2*time.Second {
		t.Errorf("drained task scheduled in %v, want at once", d)
	}
	eventually(t, 5*time.Second, "the slot refunded", func() bool {
		res, err := lim.Allow(context.Background(), "s")
		return err == nil && res.RetryAfter < 21*time.Second
	})
	b.noFailures()
}

func TestAsynqLastAttemptRequeued(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	lim := b.slowLimiter(2*time.Second, "s")
	mw := middleware(t, []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: 50 * time.Millisecond}}}, Options{Asynq: b.rdb})
	b.serve(mw, asynq.Config{})
	task := b.enqueue("slow", `{"x": 1}`, asynq.MaxRetry(0), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))

	eventually(t, 15*time.Second, "the copy run", func() bool { return len(b.runs()) == 1 })
	copyID := task.ID + "~throttled1"
	if r := b.runs()[0]; r.id != copyID {
		t.Errorf("ran task %s, want the copy %s", r.id, copyID)
	}
	if _, err := b.insp.GetTaskInfo("default", task.ID); !errors.Is(err, asynq.ErrTaskNotFound) {
		t.Errorf("original task: %v; want it revoked (not found)", err)
	}
	eventually(t, 5*time.Second, "the copy completed", func() bool { return b.info(copyID).State == asynq.TaskStateCompleted })
	c := b.info(copyID)
	if c.MaxRetry != 0 || c.Timeout != time.Minute || c.Retention != time.Hour || string(c.Payload) != `{"x": 1}` || c.Type != "slow" {
		t.Errorf("copy %+v does not keep the original's options", c)
	}
	var te *admission.ThrottledError
	if errs := b.seenErrors(); len(errs) != 1 || !errors.As(errs[0], &te) || te.Requeued != copyID || !errors.Is(errs[0], asynq.RevokeTask) {
		t.Errorf("errors %v; want one *admission.ThrottledError requeued as %s", errs, copyID)
	}
	b.noFailures()
}

func TestAsynqLastAttemptWaits(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	lim := b.slowLimiter(1500*time.Millisecond, "s")
	mw := middleware(t, []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: 50 * time.Millisecond}}})
	b.serve(mw, asynq.Config{})
	task := b.enqueue("slow", "", asynq.MaxRetry(0), asynq.Timeout(time.Minute), asynq.Retention(time.Hour))

	eventually(t, 10*time.Second, "the task run", func() bool { return len(b.runs()) == 1 })
	if w := b.runs()[0].wait; w.Duration < time.Second {
		t.Errorf("waited %v; a task with no retry left waits past MaxWait (up to its deadline) for its slot 1.5s away", w.Duration)
	}
	eventually(t, 5*time.Second, "the task completed", func() bool { return b.info(task.ID).State == asynq.TaskStateCompleted })
	if errs := b.seenErrors(); len(errs) != 0 {
		t.Errorf("errors %v", errs)
	}
	b.noFailures()
}

func TestAsynqRedisDown(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	// The limiter's Redis is not asynq's, and it is down.
	limRedis := redistest.Server(t)
	// A client that gives up at once, so that each decision fails fast.
	limClient := redis.NewClient(&redis.Options{Addr: limRedis.Addr(), MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { _ = limClient.Close() })
	lim, err := throttle.New(limClient, throttle.Options{Prefix: b.prefix}, throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
	if err != nil {
		t.Fatal(err)
	}
	m, _ := NewMetrics(prometheus.NewRegistry())
	limRedis.Stop()
	mw := middleware(t, []TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: lim, Subject: Fixed("s")}}, Options{Metrics: m, RedisRetryDelay: time.Second})
	b.serve(mw, asynq.Config{})
	task := b.enqueue("t", "", asynq.MaxRetry(1), asynq.Retention(time.Hour))
	start := time.Now()

	eventually(t, 10*time.Second, "the task deferred twice", func() bool { return len(b.seenErrors()) >= 2 })
	for _, err := range b.seenErrors() {
		var te *admission.ThrottledError
		if !errors.As(err, &te) || !errors.Is(err, throttle.ErrRedis) {
			t.Errorf("got %v; want a *admission.ThrottledError caused by Redis", err)
		}
	}
	if info := b.info(task.ID); info.Retried != 0 {
		t.Errorf("retried %d while Redis was down, want 0", info.Retried)
	}
	t.Logf("deferred twice at %v", time.Since(start))
	limRedis.Restart(t)
	t.Logf("restarted at %v", time.Since(start))
	eventually(t, 10*time.Second, "the task completed", func() bool { return b.info(task.ID).State == asynq.TaskStateCompleted })
	t.Logf("completed at %v", time.Since(start))
	if info := b.info(task.ID); info.Retried != 0 || len(b.runs()) != 1 {
		t.Errorf("retried %d, ran %d times; want 0, 1", info.Retried, len(b.runs()))
	}
	if got := testutil.ToFloat64(m.decisions.WithLabelValues("r", admission.LabelError)); got < 2 {
		t.Errorf("decisions{outcome=error} = %v, want at least 2", got)
	}
	b.noFailures()
}

func TestAsynqConfigMiddleware(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	cfg, err := rules.Parse("rules.yaml", []byte(fmt.Sprintf(`
prefix: %q
rules:
  - name: per-tenant
    tasks: ["report:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 5
    period: 1s
    burst: 1
    max_wait: 5s
`, b.prefix)))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, _ := NewMetrics(reg)
	mw, err := FromRules(cfg, b.rdb, Options{Metrics: m, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	b.serve(mw, asynq.Config{Concurrency: 6})
	for _, tenant := range []string{"a", "a", "a", "b", "b", "b"} {
		b.enqueue("report:build", `{"tenant": "`+tenant+`"}`)
	}
	eventually(t, 10*time.Second, "every task run", func() bool { return len(b.runs()) == 6 })
	by := map[string][]time.Time{}
	for _, r := range b.runs() {
		by[r.wait.Subject] = append(by[r.wait.Subject], r.at)
	}
	for tenant, at := range by {
		slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
		// Per tenant: one at once, then one each 200ms.
		if len(at) != 3 || at[2].Sub(at[0]) < 400*time.Millisecond-wakeSlack {
			t.Errorf("tenant %s: %d tasks, the last %v after the first; want 3, 400ms", tenant, len(at), at[len(at)-1].Sub(at[0]))
		}
	}
	if n, err := testutil.GatherAndCount(reg, "jobthrottle_decisions_total"); err != nil || n == 0 {
		t.Errorf("decisions series %d, %v", n, err)
	}
	b.noFailures()
}

// TestAsynqLastAttemptConcurrency: a task with no retry left and no Asynq
// to park it waits in place; under a concurrency limit it then holds a
// place, which the middleware gives back when its handler returns, so the
// next one runs (a place kept would be renewed forever).
func TestAsynqLastAttemptConcurrency(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	lim := b.limiter(throttle.Rule{Name: "one", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 1, Period: 30 * time.Second}})
	mw := middleware(t, []TaskRule{{Name: "one", Tasks: []string{"t"}, Limiter: lim, Subject: Fixed("s")}})
	b.serve(mw, asynq.Config{Concurrency: 1})
	for range 3 {
		b.enqueue("t", "", asynq.MaxRetry(0), asynq.Timeout(time.Minute))
	}
	eventually(t, 10*time.Second, "three runs, one after another", func() bool { return len(b.runs()) == 3 })
	if err := lim.Release(context.Background(), "s"); err == nil {
		t.Error("a place is still held after every task ended")
	}
	b.noFailures()
}

// TestAsynqLine parks 40 tasks of one subject at 10/s behind a middleware
// with wake-ups: the turns within the 1s horizon are booked, the rest wait
// in the subject's line and are booked by the wake-up loop's servings.
// Every task runs once, none fails, the runs are 100ms apart on the Redis
// clock, and jobthrottle_line_turns_total counts the turns the servings
// booked.
func TestAsynqLine(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	m, _ := NewMetrics(prometheus.NewRegistry())
	lim := b.limiter(throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
	mw := middleware(t, []TaskRule{{Name: "api", Tasks: []string{"api:*"}, Limiter: lim, Subject: PayloadField("acct")}}, Options{Asynq: b.rdb, Metrics: m})
	b.serve(mw, asynq.Config{Concurrency: 8})
	const n = 40
	for range n {
		b.enqueue("api:call", `{"acct": "a1"}`, asynq.MaxRetry(2))
	}
	eventually(t, 30*time.Second, "all tasks run", func() bool { return len(b.runs()) == n })
	var turns []time.Time
	for _, r := range b.runs() {
		turns = append(turns, r.wait.Turn)
	}
	// The promise is per window: a task back late for its booked turn,
	// within the tolerance (one interval), runs on it as late as it came,
	// so on a loaded machine two turns may be closer than 100ms, never
	// more than limit + burst in a second.
	if most := redistest.MaxInWindow(turns, time.Second); most > 11 {
		t.Errorf("%d turns in one second on the Redis clock; the rule allows 10 + burst 1", most)
	}
	// About 30 of the 40 turns were more than a second away: the line's.
	if got := testutil.ToFloat64(m.lineTurns.WithLabelValues("api")); got < 20 || got > n {
		t.Errorf("line_turns_total = %v, want the 30 or so tasks past the horizon", got)
	}
	b.noFailures()
}

// TestAsynqStackedLines runs two rules in two middlewares stacked on one
// server (mux.Use(a.Wrap, b.Wrap)), each with a backlog past its horizon.
// Both middlewares' wake-up loops take servings from the one ledger; a
// serving taken by the middleware without the rule is passed to the one
// with it, not dropped, so both lines drain at their rates: no gap in a
// rule's turns (a dropped serving left gaps of over 3s, until a task came
// back at its fallback and asked for one), and about two limiter calls per
// task.
func TestAsynqStackedLines(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	limRDB := b.proc.Client(t)
	calls := redistest.CountScripts(limRDB)
	var mws []*Middleware
	for _, name := range []string{"a", "b"} {
		lim, err := throttle.New(limRDB, throttle.Options{Prefix: b.prefix}, throttle.Rule{Name: name, Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		if err != nil {
			t.Fatal(err)
		}
		mws = append(mws, middleware(t, []TaskRule{{Name: name, Tasks: []string{name + ":*"}, Limiter: lim, Subject: Fixed("s")}}, Options{Asynq: b.rdb}))
	}
	b.serveStacked(asynq.Config{Concurrency: 8}, mws...)
	const n = 30
	for range n {
		b.enqueue("a:call", `{}`, asynq.MaxRetry(2))
		b.enqueue("b:call", `{}`, asynq.MaxRetry(2))
	}
	eventually(t, 30*time.Second, "all tasks run", func() bool { return len(b.runs()) == 2*n })
	// 2n tasks, each one call to join or book and one to redeem, plus
	// about two servings a second per line for 3s.
	// A lost serving leaves a gap in its rule's turns until a task comes
	// back at its fallback and asks for one; served, they are 100ms apart.
	for _, rule := range []string{"a", "b"} {
		var turns []time.Time
		for _, r := range b.runs() {
			if r.wait.Rule == rule {
				turns = append(turns, r.wait.Turn)
			}
		}
		slices.SortFunc(turns, time.Time.Compare)
		var gap time.Duration
		for i := 1; i < len(turns); i++ {
			gap = max(gap, turns[i].Sub(turns[i-1]))
		}
		t.Logf("rule %s: %d turns, the longest gap %v", rule, len(turns), gap)
		if gap > 1500*time.Millisecond {
			t.Errorf("rule %s: a gap of %v between two turns on the Redis clock; a serving was lost", rule, gap)
		}
	}
	t.Logf("%d limiter calls for %d tasks", calls.Load(), 2*n)
	if got, most := calls.Load(), int64(2*2*n+2*2*4+8); got > most {
		t.Errorf("%d limiter calls for %d tasks; want at most %d: servings were lost", got, 2*n, most)
	}
	b.noFailures()
}
