package worker

import (
	"errors"
	"fmt"
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

// TestAsynqWithin stacks two rules in one middleware (TaskRule.Within): a
// per-key rule of 7/s within a per-tenant rule of 10/s, and a backlog of
// 100 tasks, on asynq and miniredis in virtual time. Every task runs once,
// no failure, at the key's pace (the turns its handler sees, on the Redis
// clock, at most 7 + 1 in a second), parking once and costing about three
// limiter calls (TestStackBacklog measures 300 and 3,000); without Within,
// two middlewares took about ten per task for 40.
func TestAsynqWithin(t *testing.T) {
	t.Parallel()
	asynqWithin(t, 1, 7, 10, 100, 1, 3.6)
}

// TestAsynqWithinTenant is TestAsynqWithin for one tenant over three keys
// whose tasks together ask more than the tenant allows: 10/s a key within
// 15/s, 150 tasks of the keys in turn. Every task runs once, no failure,
// each key at most 10 + 1 and the tenant at most 15 + 1 in a second, at
// the tenant's pace, parking at most 2.2 times and costing at most 6.5 limiter
// calls a task (measured 1.6-1.9 and 5.0-5.6; about 2.25 and 9 before a held
// task's turns were booked by the calls that take them; admission's
// TestStackTenant measures 300 and 3,000).
func TestAsynqWithinTenant(t *testing.T) {
	t.Parallel()
	asynqWithin(t, 3, 10, 15, 150, 2.2, 6.5)
}

// asynqWithin runs n tasks of keys keys in turn, each under a per-key rule
// of key/s within a per-tenant rule of tenant/s, through asynq, checking
// each limit, the time, and at most maxParks parks and maxCalls limiter
// calls per task.
func asynqWithin(t *testing.T, keys, key, tenant, n int, maxParks, maxCalls float64) {
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
			{Name: "key", Tasks: []string{"api:*"}, Limiter: lim("key", key), Subject: PayloadField("key"), Within: "tenant"},
			{Name: "tenant", Tasks: []string{"other"}, Limiter: lim("tenant", tenant), Subject: PayloadField("tenant")},
		}, Options{Asynq: rdb})
		srv := b.serve(mw, asynq.Config{Concurrency: 8})
		defer srv.Shutdown()
		defer mw.Drain() // ends the wake-up loop before the bubble does
		for i := range n {
			b.enqueue("api:call", fmt.Sprintf(`{"key": "k%d", "tenant": "acme"}`, i%keys), asynq.MaxRetry(2))
		}
		start := time.Now()
		want := time.Duration(n) * time.Second / time.Duration(min(keys*key, tenant))
		eventually(t, want*2+10*time.Second, "all tasks run", func() bool { return len(b.runs()) == n })
		took := time.Since(start)
		seen, turns, ats := map[string]bool{}, map[string][]time.Time{}, []time.Time{}
		for _, r := range b.runs() {
			if seen[r.id] {
				t.Errorf("task %s ran twice", r.id)
			}
			seen[r.id] = true
			turns[r.wait.Subject] = append(turns[r.wait.Subject], r.wait.Turn)
			ats = append(ats, r.at)
		}
		for k, ts := range turns {
			if most := redistest.MaxInWindow(ts, time.Second); most > key+1 {
				t.Errorf("%d turns of key %s in one second on the Redis clock, want at most %d + 1", most, k, key)
			}
		}
		if most := redistest.MaxInWindow(ats, time.Second); most > tenant+1 {
			t.Errorf("%d tasks of the tenant started in one second, want at most %d + 1", most, tenant)
		}
		parks := 0
		for _, err := range b.seenErrors() {
			if te := (*admission.ThrottledError)(nil); errors.As(err, &te) && errors.Is(te, ErrParked) {
				parks++
			}
		}
		per := float64(calls.Load()) / float64(n)
		t.Logf("%d tasks in %v (the binding limit alone: %v): %.2f parks and %.2f limiter calls per task", n, took, want, float64(parks)/float64(n), per)
		if float64(parks) > maxParks*float64(n) {
			t.Errorf("%d parks for %d tasks, want at most %.0f each", parks, n, maxParks)
		}
		if per > maxCalls {
			t.Errorf("%.2f limiter calls per task, want at most %.1f", per, maxCalls)
		}
		if took > want*3/2+5*time.Second {
			t.Errorf("the backlog took %v, want about %v", took, want)
		}
		b.noFailures()
	})
}

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

// TestAsynqNested: the per-key rule within the tenant's with nested: true,
// from a rules file, through asynq: 150 tasks of three keys (10/s each)
// within the tenant's 15/s, each task once, the tenant and every key
// within limit + burst in every second on the Redis clock, in about the
// tenant's time, parked about once, at about two limiter calls a task; a
// cold tenant's tasks enqueued into that backlog run within a second.
func TestAsynqNested(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		cfg, err := rules.Parse("rules.yaml", []byte(fmt.Sprintf(`prefix: %q
rules:
  - name: key
    tasks: ["api:*"]
    subject: {payload_field: key}
    algorithm: gcra
    limit: 10
    period: 1s
    burst: 1
    within: tenant
    nested: true
  - name: tenant
    tasks: ["other"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 15
    period: 1s
    burst: 1
`, b.prefix)))
		if err != nil {
			t.Fatal(err)
		}
		limRDB := redistest.PipeClient(m)
		defer limRDB.Close()
		calls := redistest.CountScripts(limRDB)
		mw, err := FromRules(cfg, limRDB, Options{Asynq: rdb, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		srv := b.serve(mw, asynq.Config{Concurrency: 8})
		defer srv.Shutdown()
		defer mw.Drain()
		const n = 150
		keyOf := map[string]string{}
		for i := range n {
			info := b.enqueue("api:call", fmt.Sprintf(`{"key": "k%d", "tenant": "acme"}`, i%3), asynq.MaxRetry(2))
			keyOf[info.ID] = fmt.Sprint("k", i%3)
		}
		start := time.Now()
		want := n * time.Second / 15
		// A cold tenant's few tasks, two seconds into the hot one's
		// backlog: their own line, so they run at once, not behind it.
		time.Sleep(2 * time.Second)
		const cold = 5
		coldAt := time.Now()
		for range cold {
			info := b.enqueue("api:call", `{"key": "c0", "tenant": "cold"}`, asynq.MaxRetry(2))
			keyOf[info.ID] = "cold"
		}
		eventually(t, want*2+10*time.Second, "all tasks run", func() bool { return len(b.runs()) == n+cold })
		took := time.Since(start)
		seen, turns := map[string]bool{}, map[string][]time.Time{}
		var all []time.Time
		for _, r := range b.runs() {
			if seen[r.id] {
				t.Errorf("task %s ran twice", r.id)
			}
			seen[r.id] = true
			turns[keyOf[r.id]] = append(turns[keyOf[r.id]], r.wait.Turn)
			if keyOf[r.id] == "cold" {
				// 10/s a key, burst 1: the fifth 400ms after the first.
				if late := r.at.Sub(coldAt); late > time.Second {
					t.Errorf("a cold tenant's task ran %v after it was enqueued, behind the hot tenant's backlog", late)
				}
				continue
			}
			all = append(all, r.wait.Turn)
		}
		for k, ts := range turns {
			if most := redistest.MaxInWindow(ts, time.Second); most > 11 {
				t.Errorf("%d turns of key %s in one second on the Redis clock, want at most 10 + 1", most, k)
			}
		}
		if most := redistest.MaxInWindow(all, time.Second); most > 16 {
			t.Errorf("%d turns of the tenant in one second on the Redis clock, want at most 15 + 1", most)
		}
		parks := 0
		for _, err := range b.seenErrors() {
			if te := (*admission.ThrottledError)(nil); errors.As(err, &te) && errors.Is(te, ErrParked) {
				parks++
			}
		}
		per := float64(calls.Load()) / (n + cold)
		t.Logf("%d tasks in %v (the tenant's limit alone: %v), %d of a cold tenant: %.2f parks and %.2f limiter calls per task", n, took, want, cold, float64(parks)/(n+cold), per)
		if parks > (n+cold)*11/10 || per > 2.5 {
			t.Errorf("%d parks and %.2f limiter calls for %d tasks, want at most 1.1 and 2.5 each", parks, per, n+cold)
		}
		if took > want*11/10+2*time.Second {
			t.Errorf("the backlog took %v, want about %v", took, want)
		}
		b.noFailures()
	})
}
