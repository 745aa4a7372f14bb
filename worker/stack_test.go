package worker

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestAsynqWithin stacks two rules in one middleware (TaskRule.Within): a
// per-key rule of 7/s within a per-tenant rule of 10/s, and a backlog of
// 100 tasks, on asynq and miniredis in virtual time. Every task runs once,
// no failure, at the key's pace (the turns its handler sees, on the Redis
// clock, at most 7 + 1 in a second), parking once and costing about three
// limiter calls (TestStackBacklog measures 300 and 3,000); without Within,
// two middlewares took about ten per task for 40.
func TestAsynqWithin(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		limRDB := redistest.PipeClient(m)
		defer limRDB.Close()
		calls := redistest.CountScripts(limRDB)
		lim := func(name string, rate int) *throttle.Limiter {
			l, err := throttle.New(limRDB, throttle.Options{Prefix: b.prefix}, throttle.Rule{Name: name, Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)})
			if err != nil {
				t.Fatal(err)
			}
			return l
		}
		mw := middleware(t, []TaskRule{
			{Name: "key", Tasks: []string{"api:*"}, Limiter: lim("key", 7), Subject: PayloadField("key"), Within: "tenant"},
			{Name: "tenant", Tasks: []string{"other"}, Limiter: lim("tenant", 10), Subject: PayloadField("tenant")},
		}, Options{Asynq: rdb})
		srv := b.serve(mw, asynq.Config{Concurrency: 8})
		defer srv.Shutdown()
		defer mw.Drain() // ends the wake-up loop before the bubble does
		const n = 100
		for range n {
			b.enqueue("api:call", `{"key": "k1", "tenant": "acme"}`, asynq.MaxRetry(2))
		}
		start := time.Now()
		eventually(t, 40*time.Second, "all tasks run", func() bool { return len(b.runs()) == n })
		took := time.Since(start)
		seen, turns := map[string]bool{}, []time.Time{}
		for _, r := range b.runs() {
			if seen[r.id] {
				t.Errorf("task %s ran twice", r.id)
			}
			seen[r.id] = true
			turns = append(turns, r.wait.Turn)
		}
		if most := redistest.MaxInWindow(turns, time.Second); most > 8 {
			t.Errorf("%d turns of the key in one second on the Redis clock, want at most 7 + 1", most)
		}
		parks := 0
		for _, err := range b.seenErrors() {
			if te := (*admission.ThrottledError)(nil); errors.As(err, &te) && errors.Is(te, ErrParked) {
				parks++
			}
		}
		per := float64(calls.Load()) / n
		t.Logf("%d tasks in %v: %.2f parks and %.2f limiter calls per task", n, took, float64(parks)/n, per)
		if parks > n {
			t.Errorf("%d parks for %d tasks, want at most one each", parks, n)
		}
		if per > 3.6 {
			t.Errorf("%.2f limiter calls per task, want about 3.3", per)
		}
		b.noFailures()
	})
}

// TestWithinErrors: Within names a rule of the middleware, never comes
// back to itself, and needs a *throttle.Limiter on every rule.
func TestWithinErrors(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1)})
		if err != nil {
			t.Fatal(err)
		}
		rule := func(name, within string, l Waiter) TaskRule {
			return TaskRule{Name: name, Tasks: []string{name}, Limiter: l, Subject: Fixed("s"), Within: within}
		}
		for _, tc := range []struct {
			name  string
			rules []TaskRule
			want  string
		}{
			{"unknown", []TaskRule{rule("a", "b", lim)}, `worker: rule "a": within: no rule is named "b"`},
			{"cycle", []TaskRule{rule("a", "b", lim), rule("b", "a", lim)}, `within: rule "b" comes back to a rule it is within`},
			{"no gate", []TaskRule{rule("a", "b", lim), rule("b", "", &stubborn{})}, `worker: rule "b": within: stacked rules need a *throttle.Limiter each`},
		} {
			_, err := NewMiddleware(tc.rules, quietOptions(nil))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
			}
		}
	})
}
