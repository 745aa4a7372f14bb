package worker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestPriorityRule: a rule's Priority needs the wake-up loop (Options.Asynq)
// and is refused with a ShareLimit or over a concurrency limit; a valid
// one gives its gate the default age bound, 60 horizons, unless MaxAge is
// set, and a rule without one none.
func TestPriorityRule(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		rate, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)})
		if err != nil {
			t.Fatal(err)
		}
		conc, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "c", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Second}})
		if err != nil {
			t.Fatal(err)
		}
		ok := TaskRule{Name: "p", Tasks: []string{"a"}, Limiter: rate, Subject: Fixed("key"), Priority: PayloadPriority("prio")}
		with := func(f func(*TaskRule)) TaskRule { r := ok; f(&r); return r }
		for _, tc := range []struct {
			name string
			rule TaskRule
			opts Options
			want string
		}{
			{"no asynq", ok, Options{}, `worker: rule "p": priority: needs Options.Asynq`},
			{"share limit", with(func(r *TaskRule) { r.FairBy, r.ShareLimit = PayloadField("t"), throttle.PerSecond(10) }), Options{Asynq: rdb}, `worker: rule "p": priority: cannot be combined with share_limit`},
			{"concurrency", with(func(r *TaskRule) { r.Limiter = conc }), Options{Asynq: rdb}, `worker: rule "p": priority: cannot order a concurrency limit's queue`},
		} {
			tc.opts.Logger = quiet
			mw, err := NewMiddleware([]TaskRule{tc.rule}, tc.opts)
			if err == nil {
				mw.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
			}
		}
		mw, err := NewMiddleware([]TaskRule{ok,
			with(func(r *TaskRule) { r.Name, r.Tasks, r.MaxAge = "aged", []string{"b"}, 5*time.Second }),
			with(func(r *TaskRule) { r.Name, r.Tasks, r.Priority = "plain", []string{"c"}, nil }),
		}, Options{Asynq: rdb, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		for rule, want := range map[string]time.Duration{"p": time.Minute, "aged": 5 * time.Second, "plain": 0} {
			if got := mw.ruleNamed(rule).gate.Options().MaxAge; got != want {
				t.Errorf("rule %s: gate's MaxAge %v, want %v", rule, got, want)
			}
		}
	})
}

// TestPriorityOf: PayloadPriority reads a level 0 to 9 (0 if absent) and
// refuses others; QueuePriority gives an unlisted queue 0; a rules file's
// priority reaches its TaskRule.
func TestPriorityOf(t *testing.T) {
	ctx := context.Background()
	for payload, want := range map[string]int{`{"prio": 7}`: 7, `{}`: 0} {
		if got, err := PayloadPriority("prio")(ctx, asynq.NewTask("a", []byte(payload))); got != want || err != nil {
			t.Errorf("PayloadPriority(%s) = %d, %v; want %d", payload, got, err, want)
		}
	}
	if _, err := PayloadPriority("prio")(ctx, asynq.NewTask("a", []byte(`{"prio": 10}`))); err == nil {
		t.Error("PayloadPriority of 10: no error, want one")
	}
	if got, err := QueuePriority(map[string]int{"critical": 2})(ctx, asynq.NewTask("a", nil)); got != 0 || err != nil {
		t.Errorf("QueuePriority without a queue = %d, %v; want 0", got, err)
	}
	cfg, err := rules.Parse("rules.yaml", []byte("rules:\n"+
		"  - {name: api, tasks: [\"api:*\"], subject: {fixed: k}, algorithm: gcra, limit: 100, period: 1s,\n"+
		"     priority: {queues: {critical: 2}, max_age: 10s}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer rdb.Close()
	trs, err := (&ruleSource{rdb: rdb}).taskRules(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer closeLimiters(trs)
	if trs[0].Priority == nil || trs[0].MaxAge != 10*time.Second {
		t.Errorf("rules file's priority: TaskRule Priority set %v, MaxAge %v; want set, 10s", trs[0].Priority != nil, trs[0].MaxAge)
	}
}
