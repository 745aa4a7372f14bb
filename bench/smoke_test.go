package main

import (
	"context"
	"os/exec"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestSmoke runs one Wait scenario for 2 seconds, as the full run does but
// in this process: GCRA, R = 200/s, burst 10, W = 8, P = 1. It uses a
// throwaway redis-server if one is installed, else miniredis.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a 2-second real-time run")
	}
	var addr string
	if _, err := exec.LookPath("redis-server"); err == nil {
		srv, err := startRedis(t.Logf)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Stop)
		addr = srv.Addr
	} else {
		t.Log("redis-server not installed: using miniredis")
		addr = miniredis.RunT(t).Addr()
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	if err := warmScripts(context.Background(), rdb); err != nil {
		t.Fatal(err)
	}
	im, err := implByName("jobthrottle/gcra")
	if err != nil {
		t.Fatal(err)
	}
	const rate, burst, d = 200, 10, 2 * time.Second
	s := scenario{Impl: im, Rate: rate, Burst: burst, Waiters: 8, Procs: 1, Duration: d}
	start := time.Now().Add(200 * time.Millisecond)
	pr, err := runWorkload(workload{Mode: "wait", Impl: im.Name, Addr: addr, Rate: rate, Burst: burst,
		Waiters: s.Waiters, Key: "smoke", StartUnixNano: start.UnixNano(), Duration: d})
	if err != nil {
		t.Fatal(err)
	}
	res := analyse(s, start.UnixNano(), []*procResult{pr})
	t.Logf("admitted %d in 2 s (expected %d), %.1f/s steady, max 1 s %d, rt/permit %.3f, jain %.4f, wait p99 %.1f ms",
		res.AdmittedRun, res.ExpectedRun, res.SteadyRate, res.Max1s, res.RTPerPermit, res.Jain, res.WaitP99ms)

	if res.Errors != 0 {
		t.Errorf("errors = %d (first: %s), want 0", res.Errors, res.FirstError)
	}
	// R × 2 s plus the burst, give or take a burst: timer slack on a busy
	// machine may push the last few permits past the end.
	if got, lo, hi := res.AdmittedRun, rate*2, rate*2+2*burst; got < lo || got > hi {
		t.Errorf("admitted in 2 s = %d, want %d..%d (R × 2 s + burst %d, ± burst)", got, lo, hi, burst)
	}
	if got := res.Max1s; got > rate+burst+2 {
		t.Errorf("most admitted in any 1 s = %d, want ≤ R + burst + 2 = %d", got, rate+burst+2)
	}
	if got := res.RTPerPermit; got > 1.05 || got < 0.99 {
		t.Errorf("round trips per permit = %.3f, want 1..1.05 (one reservation per permit)", got)
	}
	if got := res.Jain; got < 0.99 {
		t.Errorf("Jain's index = %.4f over 8 waiters, want ≥ 0.99 (reservations are served in order)", got)
	}
	// A waiter queues behind the 7 others: about 8/R = 40 ms.
	if got := res.WaitP99ms; got > 200 {
		t.Errorf("Wait p99 = %.1f ms, want < 200 ms (8 waiters at 200/s wait about 40 ms)", got)
	}
}
