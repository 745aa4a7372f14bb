package admission

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestGateDrainKeepsRedeemedTurn: a job back early for its booked turn
// redeems it and waits for its slot; stopped before it (a worker draining
// for shutdown ends the wait, and the task goes back to its queue), it
// keeps that turn: back again, it runs on the same slot, and the subject's
// turns booked are one per job, so the next new job's turn is where it
// would be without the drain. On virtual time, with a backlog booked
// behind the job (a refund would give the rules nothing back then).
func TestGateDrainKeepsRedeemedTurn(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		g := newGate(t, rdb, Options{Settings: Settings{MaxWait: ms, Horizon: -1}, EarlyWait: 500 * ms}, gcra5)
		ctx := context.Background()
		start := time.Now()
		admit := func(ctx context.Context, id string) (Decision, error) {
			return g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
		}
		// job-0 runs now; job-1 .. job-4 park for 200ms .. 800ms.
		for i := range 5 {
			d, err := admit(ctx, fmt.Sprintf("job-%d", i))
			if err != nil || d.Slot.Sub(start) != time.Duration(i)*200*ms {
				t.Fatalf("job-%d: %+v, %v; want its turn at %v", i, d, err, time.Duration(i)*200*ms)
			}
		}
		// job-1 comes back early, redeems its turn at 200ms, and is
		// drained at 100ms, before its slot.
		drain, stop := context.WithCancelCause(ctx)
		time.AfterFunc(100*ms, func() { stop(errors.New("draining")) })
		if _, err := admit(drain, "job-1"); !errors.Is(err, context.Canceled) {
			t.Fatalf("job-1 drained while waiting for its turn: %v, want context.Canceled", err)
		}
		// Back at 150ms: it runs on the same turn, at 200ms.
		time.Sleep(50 * ms)
		d, err := admit(ctx, "job-1")
		if err != nil || d.Outcome != Run || d.Status != throttle.Redeemed || d.Slot.Sub(start) != 200*ms {
			t.Errorf("job-1 back after the drain: %+v, %v; want run on its turn at 200ms (redeemed)", d, err)
		}
		// Five jobs, five turns: the next job's turn is at 1s.
		d, err = admit(ctx, "job-5")
		if err != nil || d.Slot.Sub(start) != time.Second {
			t.Errorf("job-5: turn at %v (%v), want 1s: one turn booked per job across the drain", d.Slot.Sub(start), err)
		}
	})
}
