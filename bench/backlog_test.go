package main

import (
	"context"
	"os/exec"
	"testing"
)

// TestBacklogSmoke runs a tiny backlog through the backlog part's code: 40
// tasks of one subject at 20/s on three asynq servers (concurrency 20,
// max_wait 1s), parking and then deferral. Parking must meet issue 9's
// per-task targets and never pass limit + burst turns in a second; the
// deferral only has to run every task once.
func TestBacklogSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a few seconds of real time")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server is not installed: asynq and the wake-ups need a real server")
	}
	addr := testRedisAddr(t)
	cfg := defaultBacklogConfig()
	sz := backlogSize{N: 40, Rate: 20}
	for _, mode := range cfg.Modes {
		t.Run(mode, func(t *testing.T) {
			r, err := runBacklogCase(context.Background(), addr, mode, sz, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d/%d in %.2fs (target %.2fs): %.3f calls, %.3f parks+deferrals, %.3f dequeues, %.0f Redis µs per task; most in 1 s: %d turns, %d starts",
				r.Done, r.N, r.TookS, r.TargetS, r.CallsPerTask, r.ParksPerTask, r.DequeuesPerTask, r.RedisUsecPerTask, r.MaxTurns1s, r.MaxStarts1s)
			if !r.Finished || r.Done != r.N || r.DuplicateStarts != 0 {
				t.Fatalf("%d of %d tasks ran (%d twice) before the cap of %.0fs", r.Done, r.N, r.DuplicateStarts, r.CapS)
			}
			if r.OtherErrors != 0 {
				t.Errorf("%d handler errors other than parks and deferrals, first: %s", r.OtherErrors, r.FirstError)
			}
			if r.Dequeues < int64(r.N) || r.LimiterCalls < int64(r.N) {
				t.Errorf("%d dequeues and %d limiter calls for %d tasks: the counters missed some", r.Dequeues, r.LimiterCalls, r.N)
			}
			if mode != modeParking {
				return
			}
			if r.TookS > r.TargetS {
				t.Errorf("took %.2fs, want ≤ %.2fs", r.TookS, r.TargetS)
			}
			if r.CallsPerTask > 2.05 || r.ParksPerTask > 1.05 || r.DequeuesPerTask > 2.1 {
				t.Errorf("per task: %.3f limiter calls (≤ 2.05), %.3f parks (≤ 1.05), %.3f dequeues (≤ 2.1)", r.CallsPerTask, r.ParksPerTask, r.DequeuesPerTask)
			}
			if r.MaxTurns1s > r.Bound1s {
				t.Errorf("%d turns in one second on the Redis clock, want ≤ %d", r.MaxTurns1s, r.Bound1s)
			}
		})
	}
}
