package worker

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// A batch paced at 20/s (burst 1) by enqueue.PaceSpec and run by two
// workers with wake-ups, on virtual time (asynq and miniredis in a
// synctest bubble): every task runs once, on its own receipt, at exactly
// its slot, the slots 50ms apart from enqueue.Reach after the batch
// began, and nothing is charged twice. Before Reach, the first slot was
// the batch's start, which no task can reach in time: the first task came
// late for its receipt, was charged again, and ran after the whole batch.
func TestAsynqPacedBatchRunsOnItsReceipts(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		cfg := parseRules(t, `prefix: "`+b.prefix+`"
rules:
  - {name: partner, tasks: ["api:*"], subject: {fixed: partner}, algorithm: gcra, limit: 20, period: 1s, burst: 1}
`)
		for range 2 {
			mw, err := FromRules(cfg, rdb, Options{Logger: quiet, Asynq: rdb})
			if err != nil {
				t.Fatal(err)
			}
			defer mw.Close()
			srv := b.serve(mw, asynq.Config{Concurrency: 20})
			defer srv.Shutdown()
		}

		const tasks, interval = 100, 50 * time.Millisecond
		spec := enqueue.PaceSpec{Rules: cfg}
		pacer, err := spec.Pacer(rdb, "api:paced", throttle.Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		index := map[string]int{}
		slots := make([]time.Time, tasks)
		res, err := (&enqueue.Batch{Type: "api:paced", Count: tasks, Pacer: pacer, OnEnqueued: func(e enqueue.Enqueued) {
			index[e.ID], slots[e.Index] = e.Index, e.Due
		}}).Run(context.Background(), b.client)
		if err != nil || res.Enqueued != tasks {
			t.Fatalf("batch: %+v, %v; want %d enqueued", res, err, tasks)
		}
		eventually(t, time.Minute, "every task run", func() bool { return len(b.runs()) >= tasks })
		time.Sleep(5 * time.Second) // a task charged again would run by now
		runs := b.runs()
		if len(runs) != tasks {
			t.Fatalf("%d runs of %d tasks, want one each", len(runs), tasks)
		}
		seen := map[int]bool{}
		for _, r := range runs {
			i, ok := index[r.id]
			if !ok || seen[i] {
				t.Fatalf("run of task %s: unknown or run twice", r.id)
			}
			seen[i] = true
			if want := start.Add(enqueue.Reach + time.Duration(i)*interval); !slots[i].Equal(want) {
				t.Errorf("task %d: slot %v after the start, want %v", i, slots[i].Sub(start), want.Sub(start))
			}
			if !r.wait.Redeemed || !r.wait.Turn.Equal(slots[i]) || r.at.Before(slots[i]) || r.at.Sub(slots[i]) > time.Millisecond {
				t.Errorf("task %d: ran at %v on turn %v (redeemed %v), want on its receipt's slot %v (to the millisecond)",
					i, r.at.Sub(start), r.wait.Turn.Sub(start), r.wait.Redeemed, slots[i].Sub(start))
			}
		}
		// Nothing charged twice: the rule's next turn is the one after the
		// batch's last slot.
		lim, err := cfg.Limiter(rdb, "partner", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if r, err := lim.Allow(context.Background(), "partner"); err != nil || !r.Allowed {
			t.Errorf("after the batch: Allow = %+v, %v; want a permit (nothing charged twice)", r, err)
		}
		b.noFailures()
	})
}
