package worker

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// remaining reads a limiter's permits left for subject, charging nothing.
func remaining(t *testing.T, lim *throttle.Limiter, subject string) int {
	t.Helper()
	res, err := lim.AllowN(context.Background(), subject, 0)
	if err != nil {
		t.Fatal(err)
	}
	return res.Remaining
}

// TestSetCost: a rule charges its estimate, and the handler's SetCost
// settles it when the handler returns, up or down, whatever the handler
// returns; a handler that reports nothing keeps the estimate.
func TestSetCost(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "tpm", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := NewMiddleware([]TaskRule{{Name: "tpm", Tasks: []string{"llm:*"}, Limiter: lim, Subject: Fixed("api"), Cost: FixedCost(40)}}, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		handle := func(report int, fail error) error {
			return mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
				if report >= 0 {
					if err := SetCost(ctx, report+1); err != nil { // the last call counts
						t.Error(err)
					}
					if err := SetCost(ctx, report); err != nil {
						t.Error(err)
					}
				}
				return fail
			})).ProcessTask(ctx, asynq.NewTask("llm:chat", nil))
		}
		for _, tc := range []struct {
			name   string
			report int
			fail   error
			want   int
		}{
			{"down", 15, nil, 85},
			{"up", 70, nil, 30},
			{"not reported", -1, nil, 60},
			{"failed after reporting", 5, errors.New("upstream 500"), 95},
		} {
			time.Sleep(5 * time.Second) // full again
			if err := handle(tc.report, tc.fail); !errors.Is(err, tc.fail) {
				t.Fatalf("%s: handler returned %v, want %v", tc.name, err, tc.fail)
			}
			if got := remaining(t, lim, "api"); got != tc.want {
				t.Errorf("%s: remaining %d, want %d", tc.name, got, tc.want)
			}
		}
		if err := SetCost(ctx, 1); err == nil {
			t.Error("SetCost outside a middleware succeeded")
		}
	})
}

// TestSetCostTwoLimits: tokens (an estimate, settled) and requests (one per
// task) are two rules in two middlewares. A task that runs settles the
// tokens and keeps its request; one that the inner requests rule defers
// gives the tokens rule its turn back.
func TestSetCostTwoLimits(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		tokens, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "tpm", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)})
		if err != nil {
			t.Fatal(err)
		}
		requests, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "rpm", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: 10 * time.Second, Burst: 1}})
		if err != nil {
			t.Fatal(err)
		}
		outer, err := NewMiddleware([]TaskRule{{Name: "tpm", Tasks: []string{"llm:*"}, Limiter: tokens, Subject: Fixed("api"), Cost: FixedCost(40)}}, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		inner, err := NewMiddleware([]TaskRule{{Name: "rpm", Tasks: []string{"llm:*"}, Limiter: requests, Subject: Fixed("api")}}, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		ran := 0
		h := outer.Wrap(inner.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			ran++
			return SetCost(ctx, 25)
		})))
		if err := h.ProcessTask(ctx, asynq.NewTask("llm:chat", nil)); err != nil || ran != 1 {
			t.Fatalf("first task: %v, ran %d", err, ran)
		}
		if got := remaining(t, tokens, "api"); got != 75 {
			t.Errorf("tokens after the first: %d, want 75", got)
		}
		time.Sleep(time.Millisecond)
		var te *admission.ThrottledError
		if err := h.ProcessTask(ctx, asynq.NewTask("llm:chat", nil)); !errors.As(err, &te) || te.Rule != "rpm" || ran != 1 {
			t.Fatalf("second task: %v, ran %d; want deferred by rpm", err, ran)
		}
		if got := remaining(t, tokens, "api"); got != 75 {
			t.Errorf("tokens after a task that did not run: %d, want 75 (its estimate given back)", got)
		}
		if got := remaining(t, requests, "api"); got != 0 {
			t.Errorf("requests: %d left, want 0", got)
		}
	})
}

// TestSetCosts: a rule with Costs charges each limit of its policy its own
// estimate in one decision (requests 1, input and output tokens), and the
// handler's SetCosts settles each to what the call used; a limit of cost 0
// does not hold the task back.
func TestSetCosts(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rules := []throttle.Rule{
			{Name: "requests", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
			{Name: "input", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1000)},
			{Name: "output", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(500)},
		}
		lim, err := throttle.New(rdb, throttle.Options{}, rules...)
		if err != nil {
			t.Fatal(err)
		}
		left := func() [3]int {
			var got [3]int
			for i, r := range rules {
				one, err := throttle.New(rdb, throttle.Options{}, r)
				if err != nil {
					t.Fatal(err)
				}
				got[i] = remaining(t, one, "api")
			}
			return got
		}
		estimate := throttle.Costs{1, 900, 400}
		mw, err := NewMiddleware([]TaskRule{{Name: "llm", Tasks: []string{"llm:*"}, Limiter: lim, Subject: Fixed("api"),
			Costs: func(*asynq.Task) (throttle.Costs, error) { return estimate, nil }}}, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		var during [3]int
		h := mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			during = left()
			return SetCosts(ctx, throttle.Costs{1, 300, 120})
		}))
		if err := h.ProcessTask(ctx, asynq.NewTask("llm:chat", nil)); err != nil {
			t.Fatal(err)
		}
		if want := [3]int{9, 100, 100}; during != want {
			t.Errorf("while running: remaining %v, want %v", during, want)
		}
		if got, want := left(), [3]int{9, 700, 380}; got != want {
			t.Errorf("after settling: remaining %v, want %v", got, want)
		}
		// Input spent: a call whose input costs 0 runs at once.
		noop := mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
		estimate = throttle.Costs{1, 700, 0}
		if err := noop.ProcessTask(ctx, asynq.NewTask("llm:chat", nil)); err != nil {
			t.Fatal(err)
		}
		estimate = throttle.Costs{1, 0, 100}
		start := time.Now()
		if err := noop.ProcessTask(ctx, asynq.NewTask("llm:chat", nil)); err != nil {
			t.Fatal(err)
		}
		if waited := time.Since(start); waited != 0 {
			t.Errorf("a call of input cost 0 waited %v with the input rule spent", waited)
		}
		if got, want := left(), [3]int{7, 0, 280}; got != want {
			t.Errorf("at the end: remaining %v, want %v", got, want)
		}
		if err := SetCosts(ctx, throttle.Costs{1}); err == nil {
			t.Error("SetCosts outside a middleware succeeded")
		}
	})
}

// TestFromRulesLimitCosts: a rules file whose policy limits have costs of
// their own (requests 1, input and output tokens from the payload)
// charges each limit its cost, in one decision, and SetCosts settles
// each; a Cost beside Costs is refused.
func TestFromRulesLimitCosts(t *testing.T) {
	cfg, err := rules.Parse("rules.yaml", []byte("rules:\n"+
		"  - name: llm\n    tasks: [\"llm:*\"]\n    subject: {fixed: openai}\n    limits:\n"+
		"      - {name: requests, algorithm: gcra, limit: 10, period: 1s}\n"+
		"      - {name: input, algorithm: gcra, limit: 1000, period: 1s, cost: {payload_field: input_tokens}}\n"+
		"      - {name: output, algorithm: gcra, limit: 500, period: 1s, cost: {payload_field: max_tokens}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		mw, err := FromRules(cfg, rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		left := func() [3]int {
			var got [3]int
			for i, r := range cfg.Rules[0].Limits {
				lim, err := throttle.New(rdb, throttle.Options{}, r)
				if err != nil {
					t.Fatal(err)
				}
				got[i] = remaining(t, lim, "openai")
			}
			return got
		}
		var during [3]int
		h := mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
			during = left()
			return SetCosts(ctx, throttle.Costs{1, 200, 100})
		}))
		if err := h.ProcessTask(ctx, asynq.NewTask("llm:chat", []byte(`{"input_tokens": 300, "max_tokens": 400}`))); err != nil {
			t.Fatal(err)
		}
		if want := [3]int{9, 700, 100}; during != want {
			t.Errorf("while running: remaining %v, want %v", during, want)
		}
		if got, want := left(), [3]int{9, 800, 400}; got != want {
			t.Errorf("after settling: remaining %v, want %v", got, want)
		}
		lim, err := throttle.New(rdb, throttle.Options{}, cfg.Rules[0].Limits...)
		if err != nil {
			t.Fatal(err)
		}
		_, err = NewMiddleware([]TaskRule{{Name: "x", Tasks: []string{"x"}, Limiter: lim, Subject: Fixed("s"), Cost: FixedCost(1),
			Costs: func(*asynq.Task) (throttle.Costs, error) { return nil, nil }}}, Options{Logger: quiet})
		if err == nil || !strings.Contains(err.Error(), "Cost or Costs") {
			t.Errorf("Cost and Costs: %v; want an error", err)
		}
	})
}
