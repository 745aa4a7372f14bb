package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
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

// epoch is where redistest.Virtual's clock starts.
var epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeWaiter is a Waiter whose answers the test chooses.
type fakeWaiter struct {
	wait  func(ctx context.Context, subject string) error
	calls []string
}

func (f *fakeWaiter) WaitN(ctx context.Context, subject string, n int) error {
	f.calls = append(f.calls, subject)
	if f.wait == nil {
		return nil
	}
	return f.wait(ctx, subject)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// run passes task through a middleware of rules to a handler that records
// how it was admitted.
func run(t *testing.T, ctx context.Context, rules []TaskRule, task *asynq.Task, opts ...Options) (admission.Wait, bool, error) {
	t.Helper()
	mw, err := NewMiddleware(rules, quietOptions(opts))
	if err != nil {
		t.Fatal(err)
	}
	var w admission.Wait
	var called bool
	err = mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		called = true
		w, _ = admission.WaitedFrom(ctx)
		return nil
	})).ProcessTask(ctx, task)
	return w, called, err
}

func TestRuleMatching(t *testing.T) {
	named := func(name string, tasks ...string) TaskRule {
		return TaskRule{Name: name, Tasks: tasks, Limiter: &fakeWaiter{}, Subject: Fixed("s")}
	}
	mw, err := NewMiddleware([]TaskRule{
		named("all", "*"),
		named("stripe", "stripe:*"),
		named("stripe-refund", "stripe:refund:*"),
		named("charge", "stripe:charge"),
		named("email", "email:send", "email:bulk"),
	}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for typ, want := range map[string]string{
		"stripe:charge":      "charge",
		"stripe:charge:v2":   "stripe",
		"stripe:refund:full": "stripe-refund",
		"stripe:":            "stripe",
		"email:send":         "email",
		"email:bulk":         "email",
		"email:other":        "all",
		"":                   "all",
	} {
		if r := mw.rule(typ); r == nil || r.Name != want {
			t.Errorf("rule(%q) = %v, want %q", typ, r, want)
		}
	}

	mw, err = NewMiddleware([]TaskRule{named("stripe", "stripe:*")}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if r := mw.rule("email:send"); r != nil {
		t.Errorf("rule(email:send) = %q, want none", r.Name)
	}
}

func TestPassThrough(t *testing.T) {
	f := &fakeWaiter{}
	_, called, err := run(t, context.Background(), []TaskRule{{Name: "r", Tasks: []string{"stripe:*"}, Limiter: f, Subject: Fixed("s")}}, asynq.NewTask("email:send", []byte("not json")))
	if err != nil || !called || len(f.calls) != 0 {
		t.Errorf("unmatched task: err %v, handler called %v, limiter calls %v; want nil, true, none", err, called, f.calls)
	}
}

func TestNewMiddlewareErrors(t *testing.T) {
	ok := TaskRule{Name: "ok", Tasks: []string{"a"}, Limiter: &fakeWaiter{}, Subject: Fixed("s")}
	with := func(f func(*TaskRule)) TaskRule { r := ok; f(&r); return r }
	for _, tc := range []struct {
		name  string
		rules []TaskRule
		want  string
	}{
		{"no name", []TaskRule{with(func(r *TaskRule) { r.Name = "" })}, `worker: rule 0: name: must not be empty`},
		{"duplicate name", []TaskRule{ok, with(func(r *TaskRule) { r.Tasks = []string{"b"} })}, `worker: rule "ok": name: is used by two rules`},
		{"no tasks", []TaskRule{with(func(r *TaskRule) { r.Tasks = nil })}, `worker: rule "ok": tasks: must list at least one`},
		{"empty pattern", []TaskRule{with(func(r *TaskRule) { r.Tasks = []string{""} })}, `worker: rule "ok": tasks: pattern "" is empty`},
		{"inner star", []TaskRule{with(func(r *TaskRule) { r.Tasks = []string{"a*b"} })}, `worker: rule "ok": tasks: pattern "a*b": '*' may only end a pattern`},
		{"double star", []TaskRule{with(func(r *TaskRule) { r.Tasks = []string{"a**"} })}, `'*' may only end a pattern`},
		{"shared pattern", []TaskRule{ok, with(func(r *TaskRule) { r.Name = "two" })}, `worker: rule "two": tasks: pattern "a" is also in rule "ok"`},
		{"nil limiter", []TaskRule{with(func(r *TaskRule) { r.Limiter = nil })}, `worker: rule "ok": limiter: must not be nil`},
		{"nil subject", []TaskRule{with(func(r *TaskRule) { r.Subject = nil })}, `worker: rule "ok": subject: must not be nil`},
		{"negative max wait", []TaskRule{with(func(r *TaskRule) { r.MaxWait = -time.Second })}, `worker: rule "ok": max_wait: -1s must not be negative`},
		{"fair_by without asynq", []TaskRule{with(func(r *TaskRule) { r.FairBy = PayloadField("tenant") })}, `worker: rule "ok": fair_by: needs Options.Asynq`},
		{"weight zero", []TaskRule{with(func(r *TaskRule) { r.Weights = map[string]int{"gold": 0} })}, `worker: rule "ok": weights: share "gold": weight 0 must be between 1 and 1000`},
		{"share_limit without fair_by", []TaskRule{with(func(r *TaskRule) { r.ShareLimit = throttle.PerSecond(10) })}, `worker: rule "ok": share_limit: limits each share of fair_by; set fair_by too`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewMiddleware(tc.rules, Options{})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
	if _, err := NewMiddleware(nil, Options{}); err != nil {
		t.Errorf("no rules: %v; want a pass-through middleware", err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:0"}) // never called: the number is refused first
	defer rdb.Close()
	if _, err := NewMiddleware(nil, Options{Asynq: rdb, WakeupShards: 65}); err == nil || !strings.Contains(err.Error(), "65 shards; give 1 to 64") {
		t.Errorf("WakeupShards 65: %v; want an error saying the range", err)
	}
}

func TestNoSubject(t *testing.T) {
	for _, tc := range []struct {
		name    string
		subject Subject
		payload string
		want    string
	}{
		{"not json", PayloadField("tenant"), `{"tenant": `, `payload is not a JSON object, so it has no field "tenant"`},
		{"not an object", PayloadField("tenant"), `["acme"]`, `payload is not a JSON object`},
		{"missing", PayloadField("tenant"), `{"other": 1}`, `payload has no field "tenant"`},
		{"null", PayloadField("tenant"), `{"tenant": null}`, `payload field "tenant" is null; want a string or a number`},
		{"empty string", PayloadField("tenant"), `{"tenant": ""}`, `payload field "tenant" is an empty string`},
		{"object", PayloadField("tenant"), `{"tenant": {"id": 1}}`, `payload field "tenant" is an object`},
		{"func error", func(*asynq.Task) (string, error) { return "", errors.New("no tenant header") }, `{}`, `no tenant header`},
		{"func empty", func(*asynq.Task) (string, error) { return "", nil }, `{}`, `the subject is empty`},
		{"too long for throttle", Fixed(strings.Repeat("x", 1024+1)), `{}`, `throttle: invalid subject`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeWaiter{wait: func(ctx context.Context, subject string) error {
				// As the real limiter checks a subject: Validate checks a
				// fixed one the same way, and the limiter's error matches
				// ErrInvalidSubject.
				err := throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1), Subject: subject}.Validate()
				if subject == "" || err != nil {
					return fmt.Errorf("%w (%v)", throttle.ErrInvalidSubject, err)
				}
				return nil
			}}
			m, err := NewMetrics(prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			_, called, err := run(t, context.Background(), []TaskRule{{Name: "r", Tasks: []string{"*"}, Limiter: f, Subject: tc.subject}}, asynq.NewTask("report:build", []byte(tc.payload)), Options{Metrics: m})
			if called {
				t.Error("the handler ran for a task without a subject")
			}
			if !errors.Is(err, asynq.SkipRetry) || !errors.Is(err, ErrNoSubject) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v; want an error matching asynq.SkipRetry and ErrNoSubject, containing %q", err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), `worker: rule "r": task  (report:build): cannot derive the subject: `) {
				t.Errorf("message %q does not say which rule and task", err)
			}
			if got := testutil.ToFloat64(m.decisions.WithLabelValues("r", admission.LabelError)); got != 1 {
				t.Errorf("decisions{outcome=error} = %v, want 1", got)
			}
		})
	}
}

func TestDeferral(t *testing.T) {
	for _, tc := range []struct {
		name      string
		maxWait   time.Duration
		err       error
		wantAt    time.Duration
		wantCause error
		outcome   string
		wantText  string
	}{
		// The limiter sees the deadline the middleware set for max_wait;
		// the cause names max_wait, not a context deadline.
		{"past max wait", time.Second, &throttle.DelayError{Rule: "stripe", RetryAfter: 3 * time.Second, Deadline: true}, 3 * time.Second, nil, admission.LabelDeferred,
			"worker: its turn, in 3s, is past the rule's max_wait of 1s"},
		{"past deadline", 0, &throttle.DelayError{Rule: "stripe", RetryAfter: time.Minute, Deadline: true}, time.Minute, context.DeadlineExceeded, admission.LabelDeferred,
			"is past the context deadline"},
		{"redis down", time.Second, fmt.Errorf("%w eval: connection refused", throttle.ErrRedis), 7 * time.Second, throttle.ErrRedis, admission.LabelError, "connection refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				m, _ := NewMetrics(prometheus.NewRegistry())
				f := &fakeWaiter{wait: func(context.Context, string) error { return tc.err }}
				_, called, err := run(t, context.Background(), []TaskRule{{Name: "stripe", Tasks: []string{"stripe:*"}, Limiter: f, Subject: PayloadField("acct"), Settings: admission.Settings{MaxWait: tc.maxWait}}},
					asynq.NewTask("stripe:charge", []byte(`{"acct": "acct_42"}`)), Options{Metrics: m, RedisRetryDelay: 7 * time.Second})
				var te *admission.ThrottledError
				if called || !errors.As(err, &te) {
					t.Fatalf("got %v (handler ran: %v); want a *admission.ThrottledError", err, called)
				}
				if te.Rule != "stripe" || te.Subject != "acct_42" || !te.RetryAt.Equal(start.Add(tc.wantAt)) || !(tc.wantCause == nil && isMaxWaitBound(err) || tc.wantCause != nil && errors.Is(err, tc.wantCause)) || !strings.Contains(err.Error(), tc.wantText) {
					t.Errorf("got %+v; want rule stripe, subject acct_42, RetryAt start+%v, cause %v, saying %q", te, tc.wantAt, tc.wantCause, tc.wantText)
				}
				if IsFailure(err) {
					t.Error("IsFailure(deferral) = true")
				}
				if got := testutil.ToFloat64(m.decisions.WithLabelValues("stripe", tc.outcome)); got != 1 {
					t.Errorf("decisions{outcome=%s} = %v, want 1", tc.outcome, got)
				}
			})
		})
	}
}

func TestWaitBound(t *testing.T) {
	for _, tc := range []struct {
		name     string
		maxWait  time.Duration
		deadline time.Duration // 0: none
		want     time.Duration // -1: no deadline
	}{
		{"max wait only", 2 * time.Second, 0, 2 * time.Second},
		{"neither", 0, 0, -1},
		{"deadline only", 0, 10 * time.Second, 10*time.Second - deadlineMargin},
		{"max wait tighter", 2 * time.Second, 10 * time.Second, 2 * time.Second},
		{"deadline tighter", 30 * time.Second, 10 * time.Second, 10*time.Second - deadlineMargin},
		{"short deadline keeps a quarter", 30 * time.Second, time.Second, 750 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := context.Background()
				start := time.Now()
				if tc.deadline > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, tc.deadline)
					defer cancel()
				}
				got := time.Duration(-1)
				f := &fakeWaiter{wait: func(ctx context.Context, _ string) error {
					if dl, ok := ctx.Deadline(); ok {
						got = dl.Sub(start)
					}
					return nil
				}}
				if _, _, err := run(t, ctx, []TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: f, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: tc.maxWait}}}, asynq.NewTask("t", nil)); err != nil {
					t.Fatal(err)
				}
				if got != tc.want {
					t.Errorf("wait deadline start+%v, want start+%v", got, tc.want)
				}
			})
		})
	}
}

func TestWaitedFrom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, _ := NewMetrics(prometheus.NewRegistry())
		f := &fakeWaiter{wait: func(ctx context.Context, _ string) error { time.Sleep(1500 * time.Millisecond); return nil }}
		w, called, err := run(t, context.Background(), []TaskRule{{Name: "tenant", Tasks: []string{"report:*"}, Limiter: f, Subject: PayloadField("tenant")}},
			asynq.NewTask("report:build", []byte(`{"tenant": "acme"}`)), Options{Metrics: m})
		if err != nil || !called {
			t.Fatalf("err %v, called %v", err, called)
		}
		if want := (admission.Wait{Rule: "tenant", Subject: "acme", Duration: 1500 * time.Millisecond}); w != want {
			t.Errorf("WaitedFrom = %+v, want %+v", w, want)
		}
		if got := testutil.ToFloat64(m.decisions.WithLabelValues("tenant", admission.LabelWaited)); got != 1 {
			t.Errorf("decisions{outcome=waited} = %v, want 1", got)
		}
		if n := testutil.CollectAndCount(m.wait); n != 1 {
			t.Errorf("wait histogram series = %d, want 1", n)
		}
	})
	if _, ok := admission.WaitedFrom(context.Background()); ok {
		t.Error("WaitedFrom(background) reported a wait")
	}
}

func TestContextEndedWhileWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, _ := NewMetrics(prometheus.NewRegistry())
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(time.Second, cancel)
		f := &fakeWaiter{wait: func(ctx context.Context, _ string) error { <-ctx.Done(); return ctx.Err() }}
		_, called, err := run(t, ctx, []TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: f, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: time.Hour}}}, asynq.NewTask("t", nil), Options{Metrics: m})
		var te *admission.ThrottledError
		if called || !errors.Is(err, context.Canceled) || errors.As(err, &te) {
			t.Errorf("got %v (handler ran: %v); want context.Canceled, not a deferral", err, called)
		}
		if got := testutil.ToFloat64(m.decisions.WithLabelValues("r", admission.LabelRefunded)); got != 1 {
			t.Errorf("decisions{outcome=refunded} = %v, want 1", got)
		}
		if got := testutil.ToFloat64(m.waiters.WithLabelValues("r")); got != 0 {
			t.Errorf("waiters = %v after the wait, want 0", got)
		}
	})
}

func TestQueuedPastBound(t *testing.T) {
	// A window limiter's local queue returns the context's error when the
	// bound passes before the task's turn: no admission time is known.
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		f := &fakeWaiter{wait: func(ctx context.Context, _ string) error { <-ctx.Done(); return ctx.Err() }}
		_, _, err := run(t, context.Background(), []TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: f, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: 2 * time.Second}}}, asynq.NewTask("t", nil))
		var te *admission.ThrottledError
		if !errors.As(err, &te) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("got %v; want a *admission.ThrottledError caused by the bound", err)
		}
		if want := start.Add(4 * time.Second); !te.RetryAt.Equal(want) {
			t.Errorf("RetryAt = start+%v, want start+4s (deferred by as long as it waited)", te.RetryAt.Sub(start))
		}
	})
}

func TestDrain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeWaiter{wait: func(ctx context.Context, _ string) error { <-ctx.Done(); return ctx.Err() }}
		mw, err := NewMiddleware([]TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: f, Subject: Fixed("s")}}, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		h := mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return errors.New("must not run") }))
		errc := make(chan error)
		go func() { errc <- h.ProcessTask(context.Background(), asynq.NewTask("t", nil)) }()
		time.Sleep(time.Minute)
		start := time.Now()
		mw.Drain()
		err = <-errc
		var te *admission.ThrottledError
		if !errors.As(err, &te) || !errors.Is(err, ErrDraining) || !te.RetryAt.Equal(start) {
			t.Errorf("got %v; want a *admission.ThrottledError for now, caused by ErrDraining", err)
		}
		// Later tasks defer at once.
		if err := h.ProcessTask(context.Background(), asynq.NewTask("t", nil)); !errors.Is(err, ErrDraining) {
			t.Errorf("after Drain: got %v, want ErrDraining", err)
		}
	})
}

// TestRedeem runs a task paced by its producer (PrepayN, admission.ReceiptHeader)
// on the receipt, without charging the rule again, after waiting for its
// slot; a receipt that does not redeem is charged as usual.
func TestRedeem(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		if err != nil {
			t.Fatal(err)
		}
		var receipt string
		for range 8 {
			res, err := lim.PrepayN(ctx, "s", 1, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			receipt, _ = res.Receipt() // the last: its slot is 700ms away
		}
		rules := []TaskRule{{Name: "r", Tasks: []string{"t"}, Limiter: lim, Subject: Fixed("s")}}
		task := asynq.NewTaskWithHeaders("t", nil, map[string]string{admission.ReceiptHeader: receipt})
		w, called, err := run(t, ctx, rules, task)
		if err != nil || !called {
			t.Fatalf("err %v, called %v; want the receipt to admit", err, called)
		}
		if !w.Redeemed || w.Duration != 700*time.Millisecond || w.Turn.Sub(epoch) != 700*time.Millisecond {
			t.Errorf("Wait %+v; want redeemed after waiting 700ms for the turn at 700ms", w)
		}
		// Redeeming charged nothing: the next turn is still at 800ms.
		if res, _ := lim.Allow(ctx, "s"); res.Allowed || res.RetryAfter != 100*time.Millisecond {
			t.Errorf("after redeeming: %+v; want the next turn in 100ms", res)
		}
		// The receipt is spent: a task carrying it again is charged.
		w, _, err = run(t, ctx, rules, task)
		if err != nil || w.Redeemed || w.Duration != 100*time.Millisecond {
			t.Errorf("a spent receipt: err %v, %+v; want a new turn, after 100ms", err, w)
		}
	})
}

func TestMetricsRegistration(t *testing.T) {
	if _, err := NewMetrics(nil); err == nil {
		t.Error("NewMetrics(nil) succeeded")
	}
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewMetrics(reg); err == nil {
		t.Error("registering twice succeeded")
	}
	m.OnRedisError(errors.New("x"), false)
	var nilMetrics *Metrics
	nilMetrics.OnRedisError(errors.New("x"), true) // must not panic
	if got := testutil.ToFloat64(m.redisErrors); got != 1 {
		t.Errorf("redis_errors_total = %v, want 1", got)
	}
	m.decided("r", admission.LabelAdmitted)
	m.waited("r", time.Second)
	m.waiting("r", 1)
	want := `
# HELP jobthrottle_decisions_total Throttled tasks by rule and outcome: admitted, waited, redeemed, parked, deferred, refunded, error.
# TYPE jobthrottle_decisions_total counter
jobthrottle_decisions_total{outcome="admitted",rule="r"} 1
# HELP jobthrottle_redis_errors_total Errors from Redis seen by the limiters (admitted anyway if fail_open).
# TYPE jobthrottle_redis_errors_total counter
jobthrottle_redis_errors_total 1
# HELP jobthrottle_waiters Tasks waiting in handlers for their permits now, by rule.
# TYPE jobthrottle_waiters gauge
jobthrottle_waiters{rule="r"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "jobthrottle_decisions_total", "jobthrottle_redis_errors_total", "jobthrottle_waiters"); err != nil {
		t.Error(err)
	}
}

// TestCost charges each task the permits its payload names: a batch of 5
// under a burst of 5 runs at once, then one of 3 waits for 3 intervals; a
// cost of 0 runs free; a cost the burst can never hold, or one the payload
// does not give as a whole number, archives the task with the reason.
func TestCost(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "mail", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(5)})
		if err != nil {
			t.Fatal(err)
		}
		rules := []TaskRule{{Name: "mail", Tasks: []string{"mail:*"}, Limiter: lim, Subject: Fixed("smtp"), Cost: PayloadCost("recipients")}}
		task := func(payload string) *asynq.Task { return asynq.NewTask("mail:batch", []byte(payload)) }

		if w, called, err := run(t, ctx, rules, task(`{"recipients": 5}`)); err != nil || !called || w.Duration != 0 {
			t.Fatalf("5 under burst 5: %+v, %v, %v; want run at once", w, called, err)
		}
		if w, called, err := run(t, ctx, rules, task(`{"recipients": 0}`)); err != nil || !called || w.Duration != 0 {
			t.Fatalf("0 recipients: %+v, %v, %v; want run at once, free", w, called, err)
		}
		if w, called, err := run(t, ctx, rules, task(`{"recipients": 3}`)); err != nil || !called || w.Duration != 300*time.Millisecond {
			t.Fatalf("3 after 5: %+v, %v, %v; want run after 300ms (3 intervals)", w, called, err)
		}
		for _, tc := range []struct{ payload, want string }{
			{`{"recipients": 6}`, `6 permits requested, but it admits at most 5 at once`},
			{`{"recipients": "6"}`, `cannot derive the cost: payload cost field "recipients" is a string; want a whole number of permits`},
			{`{"recipients": 1.5}`, `cannot derive the cost: payload cost field "recipients" is 1.5; want a whole number of permits`},
			{`{}`, `cannot derive the cost: payload has no cost field "recipients"`},
		} {
			_, called, err := run(t, ctx, rules, task(tc.payload))
			if called || !errors.Is(err, asynq.SkipRetry) || errors.Is(err, ErrNoSubject) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: called %v, %v; want archived (SkipRetry) with %q", tc.payload, called, err, tc.want)
			}
		}
		// Nothing above charged: the next permit is where the 3 left it.
		if res, _ := lim.Allow(ctx, "smtp"); res.Allowed || res.RetryAfter != 100*time.Millisecond {
			t.Errorf("after the archived tasks: %+v; want the next permit in 100ms", res)
		}
	})
}

// quietOptions returns the first of opts (the zero Options if none) with
// the quiet logger unless it sets one.
func quietOptions(opts []Options) Options {
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.Logger == nil {
		o.Logger = quiet
	}
	return o
}

// TestFromRulesConcurrency: a rules file with a concurrency limit beside a
// rate limit in a policy builds a middleware (the rules package parses
// them: rules_test.go's TestConcurrencyConfig).
func TestFromRulesConcurrency(t *testing.T) {
	cfg, err := rules.Parse("rules.yaml", []byte("rules:\n"+
		"  - {name: partner, tasks: [\"partner:*\"], subject: {payload_field: account_id}, limits: [\n"+
		"      {name: rate, algorithm: gcra, limit: 100, period: 1s},\n"+
		"      {name: running, algorithm: concurrency, limit: 5, lease: 10s}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer rdb.Close()
	mw, err := FromRules(cfg, rdb, Options{})
	if err != nil {
		t.Fatalf("FromRules: %v", err)
	}
	_ = mw.Close()
}

// TestFairByNeedsARate refuses fair_by on a rule with a concurrency limit,
// whose queue for places has no shares.
func TestFairByNeedsARate(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "c", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := NewMiddleware([]TaskRule{{Name: "c", Tasks: []string{"a"}, Limiter: lim, Subject: Fixed("s"), FairBy: PayloadField("tenant")}}, Options{Asynq: rdb})
		if err == nil {
			mw.Close()
		}
		if want := `worker: rule "c": fair_by: cannot share a concurrency limit`; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want an error containing %q", err, want)
		}
	})
}

// TestShareLimitErrors refuses a ShareLimit that cannot be kept: not a
// rate, beside a concurrency or a window limit, under a Limiter that is not a
// *throttle.Limiter, or without the line (a negative Horizon); a valid one
// reaches the rule's gate.
func TestShareLimitErrors(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rate, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)})
		if err != nil {
			t.Fatal(err)
		}
		conc, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "c", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		window, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "w", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(100)})
		if err != nil {
			t.Fatal(err)
		}
		ok := TaskRule{Name: "s", Tasks: []string{"a"}, Limiter: rate, Subject: Fixed("key"), FairBy: PayloadField("tenant"), Settings: admission.Settings{ShareLimit: throttle.PerSecond(10)}}
		with := func(f func(*TaskRule)) TaskRule { r := ok; f(&r); return r }
		for _, tc := range []struct {
			name string
			rule TaskRule
			want string
		}{
			{"no count", with(func(r *TaskRule) { r.ShareLimit = throttle.Limit{Period: time.Second} }), `worker: rule "s": share_limit: throttle: rule "share_limit": count: 0 must be at least 1`},
			{"no period", with(func(r *TaskRule) { r.ShareLimit = throttle.Limit{Count: 10} }), `worker: rule "s": share_limit: throttle: rule "share_limit": period: 0s must be at least 1µs`},
			{"negative count", with(func(r *TaskRule) { r.ShareLimit = throttle.Limit{Count: -1, Period: time.Second} }), `worker: rule "s": share_limit: throttle: rule "share_limit": count: -1 must be at least 1`},
			{"burst past throttle's bounds", with(func(r *TaskRule) { r.ShareLimit = throttle.Limit{Count: 1, Period: 87600 * time.Hour, Burst: 40} }), `worker: rule "s": share_limit: throttle: rule "share_limit": burst: 40 burst × period / count must be at most`},
			{"negative burst", with(func(r *TaskRule) { r.ShareLimit = throttle.Limit{Count: 10, Period: time.Second, Burst: -1} }), `worker: rule "s": share_limit: throttle: rule "share_limit": burst: -1 must be at least 1`},
			{"concurrency", with(func(r *TaskRule) { r.Limiter = conc }), `worker: rule "s": share_limit: needs limits of gcra or token_bucket, which can book a turn for any moment; "c" is concurrency`},
			{"window", with(func(r *TaskRule) { r.Limiter = window }), `worker: rule "s": share_limit: needs limits of gcra or token_bucket, which can book a turn for any moment; "w" is sliding_window`},
			{"not a throttle.Limiter", with(func(r *TaskRule) { r.Limiter = &fakeWaiter{} }), `worker: rule "s": share_limit: needs a *throttle.Limiter: it is kept in the subject's line`},
			{"no line", with(func(r *TaskRule) { r.Horizon = -1 }), `worker: rule "s": limiter: admission: a share limit needs the subject's line`},
		} {
			mw, err := NewMiddleware([]TaskRule{tc.rule}, Options{Asynq: rdb, Logger: quiet})
			if err == nil {
				mw.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
			}
		}

		mw, err := NewMiddleware([]TaskRule{ok, with(func(r *TaskRule) { r.Name, r.Tasks, r.ShareLimit = "plain", []string{"b"}, throttle.Limit{} })}, Options{Asynq: rdb, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		if o := mw.ruleNamed("s").gate.Options(); o.ShareLimit != ok.ShareLimit {
			t.Errorf("gate of a rule with a share limit: share limit %+v; want %+v", o.ShareLimit, ok.ShareLimit)
		}
		if o := mw.ruleNamed("plain").gate.Options(); o.ShareLimit != (throttle.Limit{}) || o.Tolerance != 0 {
			t.Errorf("gate of a rule without: share limit %+v, tolerance %v; want none, 0", o.ShareLimit, o.Tolerance)
		}
	})
}

// TestFromRulesShareLimit: a rules file's share_limit reaches the rule's
// TaskRule and gate; a reload that changes it alone reaches the new gate.
func TestFromRulesShareLimit(t *testing.T) {
	file := func(share string) *rules.Config {
		cfg, err := rules.Parse("rules.yaml", []byte("rules:\n"+
			"  - {name: api, tasks: [\"api:*\"], subject: {payload_field: key}, algorithm: gcra, limit: 100, period: 1s,\n"+
			"     fair_by: {payload_field: tenant}, share_limit: "+share+"}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		mw, err := FromRules(file("{limit: 10, period: 1s}"), rdb, Options{Asynq: rdb, Logger: quiet})
		if err != nil {
			t.Fatalf("FromRules: %v", err)
		}
		defer mw.Close()
		want := throttle.Limit{Count: 10, Period: time.Second, Burst: 10}
		r := mw.ruleNamed("api")
		if r.ShareLimit != want || r.gate.Options().ShareLimit != want {
			t.Errorf("rule's share limit %+v, its gate's %+v; want %+v", r.ShareLimit, r.gate.Options().ShareLimit, want)
		}
		if err := mw.Reload(file("{limit: 5, period: 1s, burst: 2}")); err != nil {
			t.Fatalf("Reload: %v", err)
		}
		want = throttle.Limit{Count: 5, Period: time.Second, Burst: 2}
		if got := mw.ruleNamed("api").gate.Options().ShareLimit; got != want {
			t.Errorf("after the reload, the gate's share limit %+v; want %+v", got, want)
		}
	})
}
