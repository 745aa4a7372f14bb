package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestSmoke runs Wait scenarios for 2 seconds each, as the full run does
// but in this process: R = 200/s, burst 10, W = 8, P = 1, for GCRA and for
// the sliding log. It uses a throwaway redis-server if one is installed,
// else miniredis.
func TestSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a 2-second real-time run")
	}
	addr := testRedisAddr(t)
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	if err := warmScripts(context.Background(), rdb); err != nil {
		t.Fatal(err)
	}
	const rate, burst, d = 200, 10, 2 * time.Second
	run := func(t *testing.T, name string) *scenarioResult {
		im, err := implByName(name)
		if err != nil {
			t.Fatal(err)
		}
		s := scenario{Impl: im, Rate: rate, Burst: burst, Waiters: 8, Procs: 1, Duration: d}
		start := time.Now().Add(200 * time.Millisecond)
		pr, err := runWorkload(workload{Mode: "wait", Impl: im.Name, Addr: addr, Rate: rate, Burst: burst,
			Waiters: s.Waiters, Key: "smoke-" + name, StartUnixNano: start.UnixNano(), Duration: d})
		if err != nil {
			t.Fatal(err)
		}
		res := analyse(s, start.UnixNano(), []*procResult{pr})
		t.Logf("admitted %d in 2 s (expected %d), %.1f/s steady, max 1 s %d (Redis's clock: %s), rt/permit %.3f, jain %.4f, wait p99 %.1f ms",
			res.AdmittedRun, res.ExpectedRun, res.SteadyRate, res.Max1s, redisCell(res), res.RTPerPermit, res.Jain, res.WaitP99ms)
		if res.Errors != 0 {
			t.Errorf("errors = %d (first: %s), want 0", res.Errors, res.FirstError)
		}
		// Every permit's Redis time came back from the driver script,
		// and on that clock the limit holds exactly.
		if !res.RedisClock {
			t.Errorf("no Redis-clock figures: %d Redis times for %d permits", len(pr.RedisUs), res.Admitted)
		} else if got := res.Max1sRedis; got > res.Bound1s {
			t.Errorf("most admitted in any 1 s on Redis's clock = %d, want ≤ %d", got, res.Bound1s)
		}
		return res
	}

	t.Run("gcra", func(t *testing.T) {
		res := run(t, "jobthrottle/gcra")
		// R × 2 s plus the burst, give or take a burst: timer slack on a
		// busy machine may push the last few permits past the end.
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
	})

	// The sliding log admits R at once, then R again a period after the
	// first: on the client's clock a second can show a few more than R
	// (replies cross the window's edge), on Redis's never.
	t.Run("sliding_log", func(t *testing.T) {
		res := run(t, "jobthrottle/sliding_log")
		if res.Bound1s != rate {
			t.Errorf("bound = %d, want R = %d (a window ignores burst)", res.Bound1s, rate)
		}
		if got := res.Admitted; got < 2*rate {
			t.Errorf("admitted %d, want at least 2R = %d (two periods' worth)", got, 2*rate)
		}
	})
}

// testRedisAddr starts a throwaway redis-server for the test if one is
// installed, else miniredis, and returns its address.
func testRedisAddr(t *testing.T) string {
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Log("redis-server not installed: using miniredis")
		return miniredis.RunT(t).Addr()
	}
	srv, err := startRedis(t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return srv.Addr
}

// TestServerCost runs the server-cost part with few calls (50 and 250) for
// the control, GCRA and redis_rate. Instruction counts do not depend on
// load, so only their sanity is checked, nothing timed.
func TestServerCost(t *testing.T) {
	if testing.Short() {
		t.Skip("starts six servers under valgrind")
	}
	if _, err := exec.LookPath("valgrind"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("valgrind is not installed; scripts/test.sh installs it (Debian package valgrind)")
		}
		t.Skip("valgrind is not installed (Debian package valgrind): no server-cost measurement")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server is not installed: no server to count")
	}
	names := []string{controlCost, "jobthrottle/gcra", "redis_rate"}
	res, errs := runServerCost(context.Background(), names, 200, 10, 10_000, [2]int{50, 250}, t.Logf)
	for _, err := range errs {
		t.Error(err)
	}
	if len(res) != len(names) {
		t.Fatalf("%d results for %d cases", len(res), len(names))
	}
	for _, r := range res {
		t.Logf("%s: %.0f Ir/call (%v Ir for %v calls in %v s), %.2f cmds/call, %.2f× redis_rate's", r.Impl, r.IrPerCall, r.Ir, r.Calls, r.Seconds, r.CmdsPerCall, r.VsRedisRate)
		if r.IrPerCall <= 0 {
			t.Errorf("%s: %.0f Ir/call, want > 0", r.Impl, r.IrPerCall)
		}
		if r.CmdsPerCall < 1 {
			t.Errorf("%s: %.2f server commands per call, want ≥ 1 (the EVALSHA)", r.Impl, r.CmdsPerCall)
		}
		if r.Impl == "redis_rate" && (r.IrPerCall < 10_000 || r.IrPerCall > 1_000_000) {
			t.Errorf("redis_rate: %.0f Ir/call, want 10 000..1 000 000 (about 71 000 by hand)", r.IrPerCall)
		}
	}
}

// TestUpstreamSmoke runs the upstream part for 2 seconds with headers:
// the fleet learns L and gets (almost) no 429 after the first answers.
func TestUpstreamSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a 2-second real-time run")
	}
	addr := testRedisAddr(t)
	cfg := upstreamConfig{Phases: []upstreamPhase{{L: 40, DurationS: 1}, {L: 20, DurationS: 1}}, Workers: 2, Goroutines: 4,
		Configured: 1000, LatencyMS: 1, BinMS: 100, SettleS: 0.5, ReachWithin: 0.9}
	res, err := upstreamScenario(addr, cfg, true, "smoke-upstream:")
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || len(res.Phases) != 2 {
		t.Fatalf("result %+v", res)
	}
	if p := res.Phases[1]; p.TooMany > 5 {
		t.Errorf("%d answers of 429 after L fell to 20; the fleet should have learned it", p.TooMany)
	}
	if md := renderUpstream(&upstreamRun{Config: cfg, Scenarios: []upstreamResult{*res}}, "x.json"); !strings.Contains(md, "## Limits learned from the upstream") {
		t.Errorf("report section:\n%s", md)
	}
}
