package worker

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestAsynqDrainKeepsRedeemedTurn: a task parked on its booked turn comes
// back early, redeems the turn and waits for it in its handler; the
// worker drains for shutdown then, and the task goes back to asynq. Run
// by another worker, it runs on that same turn (redeemed), and the rule
// has booked one turn for it across the drain: the next turn is one
// interval after it, not two. On virtual time, under a real asynq server.
func TestAsynqDrainKeepsRedeemedTurn(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		lim := b.slowLimiter(4*time.Second, "s") // the next turn is 4 s away
		rules := []TaskRule{{Name: "slow", Tasks: []string{"slow"}, Limiter: lim, Subject: Fixed("s"), Settings: admission.Settings{MaxWait: 50 * time.Millisecond}}}
		m, _ := NewMetrics(prometheus.NewRegistry())
		mw := middleware(t, rules, Options{Metrics: m})
		srv := b.serve(mw, asynq.Config{})
		start := time.Now()
		task := b.enqueue("slow", "", asynq.MaxRetry(3))
		eventually(t, 10*time.Second, "the task parked", func() bool {
			return testutil.ToFloat64(m.decisions.WithLabelValues("slow", admission.LabelParked)) == 1
		})
		eventually(t, 10*time.Second, "the task back, waiting for its turn", func() bool {
			return testutil.ToFloat64(m.waiters.WithLabelValues("slow")) == 1
		})
		srv.Stop()
		mw.Drain()
		srv.Shutdown()
		if len(b.runs()) != 0 {
			t.Fatal("the task ran before the drain")
		}

		next := middleware(t, rules)
		defer next.Drain()
		srv = b.serve(next, asynq.Config{})
		defer srv.Shutdown()
		eventually(t, 10*time.Second, "the task run after the drain", func() bool { return len(b.runs()) == 1 })
		r := b.runs()[0]
		if r.id != task.ID || !r.wait.Redeemed {
			t.Errorf("ran %s %+v; want %s on its redeemed turn", r.id, r.wait, task.ID)
		}
		if turn := r.wait.Turn.Sub(start); turn < 3500*time.Millisecond || turn > 4500*time.Millisecond {
			t.Errorf("ran on the turn at %v, want the one booked about 4 s in", turn)
		}
		// One turn for the task: the next is 4 s after it.
		res, err := lim.Allow(context.Background(), "s")
		if want := r.wait.Turn.Add(4 * time.Second); err != nil || res.Allowed || time.Now().Add(res.RetryAfter).After(want.Add(time.Millisecond)) {
			t.Errorf("the rule's next turn in %v (%v); want at most %v: one turn booked for the task", res.RetryAfter, err, time.Until(want))
		}
		b.noFailures()
	})
}
