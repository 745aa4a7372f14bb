package worker

import (
	"context"
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The turn book counts each rule's turns until they come (to within a
// grain) and says how far ahead the furthest is, falling as time passes;
// a process nobody scrapes drops the turns that have come as it adds
// others, so it keeps a bucket per grain of turns ahead, not one per turn.
func TestTurnBook(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &turnBook{}
		reg := prometheus.NewRegistry()
		reg.MustRegister(b)
		now := time.Now()
		for _, ahead := range []time.Duration{500 * time.Millisecond, 520 * time.Millisecond, time.Second, 3 * time.Second} {
			b.add("a", now.Add(ahead))
		}
		b.add("b", now.Add(200*time.Millisecond))
		check := func(when string, want map[string][2]float64) {
			t.Helper()
			s := scrape(t, reg)
			for rule, w := range want {
				if got := s["jobthrottle_booked_turns"]["rule="+rule]; got != w[0] {
					t.Errorf("%s: booked_turns{rule=%s} = %v, want %v", when, rule, got, w[0])
				}
				if got := s["jobthrottle_furthest_turn_seconds"]["rule="+rule]; math.Abs(got-w[1]) > 1e-9 {
					t.Errorf("%s: furthest_turn_seconds{rule=%s} = %v, want %v", when, rule, got, w[1])
				}
			}
		}
		check("at once", map[string][2]float64{"a": {4, 3}, "b": {1, 0.2}})
		time.Sleep(600 * time.Millisecond) // the turns at 0.5 s and 0.52 s have come, and b's
		check("after 0.6 s", map[string][2]float64{"a": {2, 2.4}, "b": {0, 0}})
		time.Sleep(3 * time.Second)
		check("after 3.6 s", map[string][2]float64{"a": {0, 0}, "b": {0, 0}})

		// Unscraped: adding prunes at most once a second.
		for i := range 100 {
			b.add("c", time.Now().Add(50*time.Millisecond))
			if i%10 == 9 {
				time.Sleep(time.Second)
			}
		}
		b.mu.Lock()
		buckets := len(b.rules["c"].counts)
		b.mu.Unlock()
		if buckets > 2 {
			t.Errorf("%d buckets held for turns 50 ms ahead added over 10 s; want the turns that have come dropped", buckets)
		}
	})
}

// ctxKey marks the contexts of a test's task handlers.
type ctxKey struct{}

// onTaskPath reports whether ctx is a task handler's (asynq.Config's
// BaseContext marked it).
func onTaskPath(ctx context.Context) bool { return ctx.Value(ctxKey{}) != nil }

// A backlog parked on booked turns under a real asynq server, with the
// metrics on: the turn book counts the parked tasks and how far ahead the
// rule is booked, and both fall to zero once every task has run. A
// task's path sends Redis only the limiter's calls that its decision
// takes (one script to be admitted, waited or redeemed; two to park: the
// booking and the wake-up), whatever the metrics keep.
func TestAsynqBookedTurnsGauges(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		calls := redistest.CountCommands(rdb, onTaskPath)
		reg := prometheus.NewRegistry()
		m, err := NewMetrics(reg)
		if err != nil {
			t.Fatal(err)
		}
		lim := b.limiter(throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1).WithBurst(1)})
		mw := middleware(t, []TaskRule{{Name: "api", Tasks: []string{"api"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: 100 * time.Millisecond, Horizon: -1}}},
			Options{Asynq: rdb, Metrics: m})
		defer mw.Drain()
		srv := b.serve(mw, asynq.Config{Concurrency: 8, BaseContext: func() context.Context { return context.WithValue(context.Background(), ctxKey{}, true) }})
		defer srv.Shutdown()
		const n = 5
		for range n {
			b.enqueue("api", "", asynq.MaxRetry(2))
		}
		eventually(t, 10*time.Second, "four tasks parked", func() bool {
			return scrape(t, reg)["jobthrottle_decisions_total"]["outcome=parked,rule=api"] == n-1
		})
		s := scrape(t, reg)
		if got := s["jobthrottle_booked_turns"]["rule=api"]; got != n-1 {
			t.Errorf("booked_turns = %v, want %d", got, n-1)
		}
		// The last of the turns, a second apart, is 4 s after the first,
		// less the moments asynq took to bring the tasks.
		if got := s["jobthrottle_furthest_turn_seconds"]["rule=api"]; got < 3.5 || got > 4 {
			t.Errorf("furthest_turn_seconds = %v, want about 4", got)
		}
		eventually(t, 10*time.Second, "every task run", func() bool { return len(b.runs()) == n })
		time.Sleep(turnGrain) // a turn counts until at most a grain after it
		s = scrape(t, reg)
		if got := s["jobthrottle_booked_turns"]["rule=api"] + s["jobthrottle_furthest_turn_seconds"]["rule=api"]; got != 0 {
			t.Errorf("booked_turns and furthest_turn_seconds %v after every turn came; want 0", s)
		}

		d := s["jobthrottle_decisions_total"]
		decided := d["outcome=admitted,rule=api"] + d["outcome=waited,rule=api"] + d["outcome=redeemed,rule=api"]
		want := map[string]int{"evalsha": int(decided + 2*d["outcome=parked,rule=api"])}
		if got := calls.ByName(false); !equalCounts(perTask(got), want) {
			t.Errorf("the tasks' paths sent %v for decisions %v; want %v: one script per admission, two per park, nothing else", got, d, want)
		}
		srv.Shutdown()
	})
}

// perTask is counts without what a process or a connection pays once,
// whichever task happens to pay it: a new connection's handshake (HELLO,
// CLIENT SETINFO), and a script's first run on a Redis that has not
// loaded it (go-redis's Script.Run: an EVALSHA answered NOSCRIPT, then
// EVAL or SCRIPT LOAD; the EVALSHA is the call counted).
func perTask(counts map[string]int) map[string]int {
	for _, name := range []string{"hello", "client", "eval", "script"} {
		delete(counts, name)
	}
	return counts
}
