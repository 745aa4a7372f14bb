package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A leased "hot" child on a real server for a second: it records every
// admission in its file, leases (few script calls per permit), and the
// report renders the part.
func TestLeasedSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a 1-second real-time run")
	}
	addr := testRedisAddr(t)
	const rate, d = 20_000, time.Second
	w := workload{Mode: "hot", Impl: "jobthrottle/gcra", Addr: addr, Rate: rate, Burst: 20, Waiters: 8, Key: "hot-smoke",
		StartUnixNano: time.Now().Add(100 * time.Millisecond).UnixNano(), Duration: d, HotOp: "wait",
		LeaseNs: 5 * time.Millisecond, File: filepath.Join(t.TempDir(), "rec")}
	pr, err := runWorkload(w)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := readRecords(w.File)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(ts)) != pr.Allowed || len(ts) == 0 {
		t.Fatalf("%d admissions in the file, %d counted", len(ts), pr.Allowed)
	}
	if most, lim := maxInWindow(ts, int64(time.Second)), 20+rate*1005/1000+1; most > lim {
		t.Errorf("%d admitted in a 1 s window, want at most %d", most, lim)
	}
	var calls int64
	for _, n := range pr.ScriptOps {
		calls += n
	}
	if calls*2 > int64(len(ts)) {
		t.Errorf("%d script calls (%v) for %d permits: want leases", calls, pr.ScriptOps, len(ts))
	}
	t.Logf("%d admitted, script calls %v", len(ts), pr.ScriptOps)

	c := &leasedCase{Name: "jobthrottle/gcra, leased Wait", LeaseMs: 5, Admitted: len(ts), SteadyPS: float64(len(ts)), PerProc: []int{len(ts)},
		Max1s: len(ts), Ops: pr.ScriptOps}
	run := &leasedRun{Config: defaultLeasedConfig(), Cases: []*leasedCase{c}, Low: &leasedLow{Admitted: 20, Scripts: 20}}
	md := renderLeased(run, "bench/results/x-leased.json")
	for _, want := range []string{"## One hot key past one shard", "| jobthrottle/gcra, leased Wait |", "x-leased.png", "Fallback"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
}
