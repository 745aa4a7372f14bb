package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// parseRules parses a rules file body, failing the test if it does not.
func parseRules(t *testing.T, body string) *rules.Config {
	t.Helper()
	cfg, err := rules.Parse("rules.yaml", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// tally passes n tasks of type typ through mw, one after another, and
// returns how many ran and how many were deferred; any other error fails
// the test.
func tally(t *testing.T, mw *Middleware, typ string, n int, headers map[string]string) (ran, deferred int) {
	t.Helper()
	h := mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	for range n {
		err := h.ProcessTask(context.Background(), asynq.NewTaskWithHeaders(typ, nil, headers))
		var te *admission.ThrottledError
		switch {
		case err == nil:
		case errors.As(err, &te):
			deferred++
		default:
			t.Fatalf("task %s: %v", typ, err)
		}
	}
	return ran, deferred
}

// fixedRule is a rules file with one fixed-window rule "api" of limit
// tasks per second for task type "api", which waits at most 1ms.
func fixedRule(limit int) string {
	return fmt.Sprintf("rules:\n  - {name: api, tasks: [api], subject: {fixed: all}, algorithm: fixed_window, limit: %d, period: 1s, max_wait: 1ms}\n", limit)
}

// TestReloadSwapsLimits: after Reload, the new limit decides, on the
// state the old one left: what it admitted and what it booked count.
func TestReloadSwapsLimits(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		old := parseRules(t, fixedRule(2))
		mw, err := FromRules(old, rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		// Second 0 (the clock starts on a window's edge), at 2/s.
		if ran, deferred := tally(t, mw, "api", 3, nil); ran != 2 || deferred != 1 {
			t.Fatalf("2/s: %d ran, %d deferred; want 2, 1", ran, deferred)
		}
		// Two turns of second 1 booked under the old limit (a producer's).
		lim, err := old.Limiter(rdb, "api", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		var receipts []string
		for range 2 {
			booked, err := lim.PrepayN(context.Background(), "all", 1, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			r, _ := booked.Receipt()
			receipts = append(receipts, r)
		}

		if err := mw.Reload(parseRules(t, fixedRule(5))); err != nil {
			t.Fatalf("Reload: %v", err)
		}
		time.Sleep(time.Second)
		// Second 1: the bookings made under 2/s are kept and redeemed, and
		// the new limit fills the rest of the second: 5 in all, not more.
		for _, r := range receipts {
			var w admission.Wait
			err := mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
				w, _ = admission.WaitedFrom(ctx)
				return nil
			})).ProcessTask(context.Background(), asynq.NewTaskWithHeaders("api", nil, map[string]string{admission.ReceiptHeader: r}))
			if err != nil || !w.Redeemed {
				t.Errorf("a task booked under 2/s: err %v, %+v; want it run on its booking", err, w)
			}
		}
		if ran, deferred := tally(t, mw, "api", 10, nil); ran != 3 || deferred != 7 {
			t.Errorf("second 1 at 5/s, two turns booked: %d ran, %d deferred; want 3, 7", ran, deferred)
		}
		// Second 2: 5, not more.
		time.Sleep(time.Second)
		if ran, deferred := tally(t, mw, "api", 10, nil); ran != 5 || deferred != 5 {
			t.Errorf("second 2 at 5/s: %d ran, %d deferred; want 5, 5", ran, deferred)
		}
	})
}

// TestReloadRefused: a config that cannot replace the rules in force
// returns an error naming the problem, and the old rules keep working.
func TestReloadRefused(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		mw, err := FromRules(parseRules(t, fixedRule(2)), rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		before := mw.table.Load()
		added := func(f func(*throttle.Rule)) *rules.Config {
			cfg := parseRules(t, fixedRule(2)+"  - {name: new, tasks: [new], subject: {fixed: all}, algorithm: gcra, limit: 5, period: 1s}\n")
			f(&cfg.Rules[1].Limits[0])
			return cfg
		}
		for _, tc := range []struct {
			name string
			cfg  *rules.Config
			want string
		}{
			{"prefix", parseRules(t, "prefix: \"other:\"\n"+fixedRule(5)), `worker: reload refused: rules.yaml: prefix: "other:" was "jobthrottle:": a new prefix moves every key`},
			{"algorithm", parseRules(t, "rules:\n  - {name: api, tasks: [api], subject: {fixed: all}, algorithm: sliding_log, limit: 5, period: 1s}\n"),
				`rules.yaml:2: rule "api": algorithm: sliding_log was fixed_window: the state of the old algorithm in Redis cannot be read by the new one; give the limit a new name`},
			{"fixed window period", parseRules(t, "rules:\n  - {name: api, tasks: [api], subject: {fixed: all}, algorithm: fixed_window, limit: 2, period: 1m}\n"),
				`rules.yaml:2: rule "api": period: 1m0s was 1s: a fixed window's state in Redis counts windows of its period`},
			{"bad limit", added(func(r *throttle.Rule) { r.Limit.Count = 0 }), `rule "new"`},
			{"unknown algorithm", added(func(r *throttle.Rule) { r.Algorithm = "leaky" }), `"leaky" is not one of`},
			{"nil", nil, "worker: Reload: nil rules"},
		} {
			// No t.Run: a synctest bubble allows none.
			if err := mw.Reload(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: Reload: %v; want an error containing %q", tc.name, err, tc.want)
			}
		}
		if mw.table.Load() != before {
			t.Fatal("a refused Reload changed the rules")
		}
		if ran, deferred := tally(t, mw, "api", 3, nil); ran != 2 || deferred != 1 {
			t.Errorf("after the refused reloads: %d ran, %d deferred; want 2, 1 (the old 2/s)", ran, deferred)
		}
		if ran, _ := tally(t, mw, "new", 10, nil); ran != 10 {
			t.Errorf("the refused rule's tasks: %d of 10 ran; want all, unthrottled", ran)
		}
	})
	mw, err := NewMiddleware(nil, Options{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := mw.Reload(parseRules(t, fixedRule(1))); err == nil || !strings.Contains(err.Error(), "not built by FromRules") {
		t.Errorf("Reload of a NewMiddleware: %v; want an error saying it needs FromRules", err)
	}
}

// TestReloadInFlight: a task running under a concurrency rule keeps the
// rule it was admitted by across reloads, even one that removes the rule,
// and gives its place back through it when it returns; the new limit
// counts the place it holds. On asynq and miniredis in a synctest bubble:
// a place is held under the task's ID.
func TestReloadInFlight(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		places := func(n int) *rules.Config {
			return parseRules(t, fmt.Sprintf("prefix: %q\nrules:\n  - {name: exports, tasks: [export], subject: {fixed: all}, algorithm: concurrency, limit: %d, lease: 3s, max_wait: 1ms}\n", b.prefix, n))
		}
		mw, err := FromRules(places(1), rdb, Options{Logger: quiet, Asynq: rdb})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()

		entered, release := make(chan admission.Wait, 1), make(chan struct{})
		var once sync.Once
		unblock := func() { once.Do(func() { close(release) }) }
		defer unblock()
		var mu sync.Mutex
		done := map[string]time.Time{}
		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		mux.HandleFunc("export", func(ctx context.Context, task *asynq.Task) error {
			if string(task.Payload()) == "hold" {
				w, _ := admission.WaitedFrom(ctx)
				entered <- w
				<-release
			}
			id, _ := asynq.GetTaskID(ctx)
			mu.Lock()
			defer mu.Unlock()
			done[id] = time.Now()
			return nil
		})
		srv := asynq.NewServerFromRedisClient(rdb, Configure(asynq.Config{Concurrency: 4, LogLevel: asynq.FatalLevel,
			TaskCheckInterval: 50 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, ShutdownTimeout: 2 * time.Second}))
		if err := srv.Start(mux); err != nil {
			t.Fatal(err)
		}
		defer srv.Shutdown()
		ran := func(id string) bool {
			mu.Lock()
			defer mu.Unlock()
			_, ok := done[id]
			return ok
		}

		first := b.enqueue("export", "hold", asynq.Retention(time.Hour))
		if w := <-entered; w.Rule != "exports" {
			t.Fatalf("the first task ran under %+v; want rule exports", w)
		}
		// One place, held: the next task parks for it.
		second := b.enqueue("export", "", asynq.Retention(time.Hour))
		eventually(t, 10*time.Second, "the second task parked", func() bool { return b.info(second.ID).State == asynq.TaskStateRetry })

		// Two places now, one of them held by the first task: the second
		// takes the other (the sweep, on the new limiter, hands it over).
		if err := mw.Reload(places(2)); err != nil {
			t.Fatal(err)
		}
		eventually(t, 10*time.Second, "the second task run beside the first", func() bool { return ran(second.ID) })

		// The rule removed: its task type is no longer throttled.
		if err := mw.Reload(parseRules(t, fmt.Sprintf("prefix: %q\n", b.prefix)+fixedRule(1))); err != nil {
			t.Fatal(err)
		}
		third := b.enqueue("export", "", asynq.Retention(time.Hour))
		eventually(t, 10*time.Second, "the third task run", func() bool { return ran(third.ID) })

		// The first task ends: its place goes back through the limiter
		// that granted it. With the rule back at one place, the next task
		// takes it at once: well before the lease (3s) would have expired,
		// and a place kept would be renewed forever.
		unblock()
		eventually(t, 10*time.Second, "the first task done", func() bool { return ran(first.ID) })
		if err := mw.Reload(places(1)); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		fourth := b.enqueue("export", "", asynq.Retention(time.Hour))
		eventually(t, 10*time.Second, "the fourth task run", func() bool { return ran(fourth.ID) })
		mu.Lock()
		took := done[fourth.ID].Sub(start)
		mu.Unlock()
		if took > time.Second {
			t.Errorf("the fourth task ran %v after it was enqueued; want at once, the first task's place given back", took)
		}
		srv.Shutdown()
		b.noFailures()
	})
}

// FromRules publishes the limits of its rules for producers to check
// theirs against, and Reload publishes the new ones: a producer with the
// workers' old file is then refused, one with the new file is not.
func TestRulesPublishLimits(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		old, changed := parseRules(t, fixedRule(2)), parseRules(t, fixedRule(5))
		lim := func(cfg *rules.Config) []throttle.Rule {
			l, err := cfg.Limiter(rdb, "api", throttle.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return l.Rules()
		}
		if err := admission.CheckLimits(ctx, rdb, throttle.DefaultPrefix, lim(changed)); err != nil {
			t.Fatalf("before any worker ran: %v, want nil", err)
		}
		mw, err := FromRules(old, rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		if got := rdb.HGet(ctx, admission.LimitsKey(throttle.DefaultPrefix), "api").Val(); got != "fixed_window 2 per 1s" {
			t.Errorf("published %q, want %q", got, "fixed_window 2 per 1s")
		}
		var mm *admission.LimitMismatchError
		if err := admission.CheckLimits(ctx, rdb, throttle.DefaultPrefix, lim(changed)); !errors.As(err, &mm) {
			t.Errorf("a producer at 5/s beside workers at 2/s: %v, want a *admission.LimitMismatchError", err)
		}
		if err := mw.Reload(changed); err != nil {
			t.Fatal(err)
		}
		if err := admission.CheckLimits(ctx, rdb, throttle.DefaultPrefix, lim(changed)); err != nil {
			t.Errorf("after the reload to 5/s, a producer at 5/s: %v, want nil", err)
		}
		if err := admission.CheckLimits(ctx, rdb, throttle.DefaultPrefix, lim(old)); !errors.As(err, &mm) || mm.Workers != "fixed_window 5 per 1s" {
			t.Errorf("after the reload to 5/s, a producer with the old file: %v, want the workers' 5 per 1s named", err)
		}
	})
}
