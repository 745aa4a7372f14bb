package main

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestFairShares runs the example and checks what fair_by promises. Every
// small task ran once. Each small tenant, enqueued behind big's backlog,
// was done within the time its 20 tasks take at its smallest share of the
// key (its weight over all three tenants' weights: small-a 1/4, 5/s, 4s;
// small-b 2/4, 2s), plus the horizon (big's turns booked up to 1s ahead
// when the small tenants arrive) and 4s of slack for a loaded machine
// (at load 11 on 2 cores they were 2.4s late): 9s and 7s, where first
// come, first served would take 14s or more (big's backlog at 20/s),
// which the test also checks. small-b, weighing two,
// was done before small-a. And the key never passed its limit plus burst
// in any second on the Redis clock.
func TestFairShares(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 5s")
	}
	cfg := defaults
	s, err := run(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range s.Tenants {
		t.Logf("%-8s weight %d: %3d of %3d started, first %5.2fs, last %5.2fs, %5.1f/s",
			r.Tenant, r.Weight, r.Started, r.Tasks, r.First.Seconds(), r.Last.Seconds(), r.Rate)
	}
	t.Logf("small tenants enqueued at %.2fs behind %d of big's tasks, done at %.2fs", s.Joined.Seconds(), s.BigWaiting, s.SmallsDone.Seconds())

	if len(s.Errors) > 0 {
		t.Errorf("%d handler errors other than parking or draining, first: %v", len(s.Errors), s.Errors[0])
	}
	for id, n := range s.Starts {
		if n != 1 {
			t.Errorf("task %s (%s) started %d times, want once", id, s.Enqueued[id], n)
		}
	}
	for id, tenant := range s.Enqueued {
		if tenant != big && s.Starts[id] != 1 {
			t.Errorf("task %s of %s started %d times, want once", id, tenant, s.Starts[id])
		}
	}

	total := 0
	for _, w := range weights {
		total += w
	}
	fcfs := time.Duration(s.BigWaiting) * time.Second / time.Duration(cfg.Rate)
	const horizon, slack = time.Second, 4 * time.Second
	last := map[string]time.Duration{}
	for _, r := range s.Tenants[1:] {
		last[r.Tenant] = r.Last
		share := float64(cfg.Rate) * float64(r.Weight) / float64(total)
		bound := time.Duration(float64(cfg.Small)/share*float64(time.Second)) + horizon + slack
		if bound >= fcfs {
			t.Fatalf("%s: bound %v not under first come, first served's %v: the test proves nothing", r.Tenant, bound, fcfs)
		}
		if r.Started != cfg.Small {
			t.Errorf("%s: %d of %d tasks started", r.Tenant, r.Started, cfg.Small)
		}
		if took := r.Last - s.Joined; took > bound {
			t.Errorf("%s: done %.1fs after it enqueued, want within %.1fs (its share, %.1f/s, the horizon and slack); first come, first served: %.1fs",
				r.Tenant, took.Seconds(), bound.Seconds(), share, fcfs.Seconds())
		}
		if wait := r.First - s.Joined; wait > horizon+slack {
			t.Errorf("%s: first task %.1fs after it enqueued, want within %.1fs", r.Tenant, wait.Seconds(), (horizon + slack).Seconds())
		}
	}
	if last["small-b"] >= last["small-a"] {
		t.Errorf("small-b (weight 2) done at %.1fs, small-a (weight 1) at %.1fs: want small-b first", last["small-b"].Seconds(), last["small-a"].Seconds())
	}
	for _, turn := range s.Turns {
		if turn.IsZero() {
			t.Fatal("a task started with no turn of the key (admission.WaitedFrom)")
		}
	}
	if most := redistest.MaxInWindow(s.Turns, time.Second); most > cfg.Rate+1 {
		t.Errorf("%d turns of the key in one second on the Redis clock, want at most %d", most, cfg.Rate+1)
	}
}
