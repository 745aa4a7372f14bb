package main

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	xs := []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct {
		p    float64
		want int64
	}{{50, 5}, {99, 10}, {100, 10}, {0, 1}, {10, 1}, {11, 2}} {
		if got := percentile(xs, c.p); got != c.want {
			t.Errorf("percentile(1..10, %v) = %d, want %d", c.p, got, c.want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil) = %d, want 0", got)
	}
}

func TestMaxInWindow(t *testing.T) {
	ts := []int64{0, 1, 2, 10, 11, 12, 13, 30}
	for _, c := range []struct {
		w    int64
		want int
	}{{1, 1}, {3, 3}, {4, 4}, {11, 4}, {14, 7}, {31, 8}} {
		if got := maxInWindow(ts, c.w); got != c.want {
			t.Errorf("maxInWindow(w=%d) = %d, want %d", c.w, got, c.want)
		}
	}
}

func TestMaxAligned(t *testing.T) {
	// base 5: absolute times 5, 9, 10, 11, 19, 20 → windows of 10: [0,10) has 2, [10,20) has 3, [20,30) 1.
	if got := maxAligned([]int64{0, 4, 5, 6, 14, 15}, 5, 10); got != 3 {
		t.Errorf("maxAligned = %d, want 3", got)
	}
}

func TestJitterAndJain(t *testing.T) {
	j := jitter([]int64{0, 5, 10, 16, 20, 100}, 0, 50, 5)
	want := []int64{0, 0, 1, 1}
	if len(j) != len(want) {
		t.Fatalf("jitter = %v, want %v", j, want)
	}
	for i := range want {
		if j[i] != want[i] {
			t.Fatalf("jitter = %v, want %v", j, want)
		}
	}
	if got := jain([]int{3, 3, 3}); got != 1 {
		t.Errorf("jain(equal) = %v, want 1", got)
	}
	if got := jain([]int{4, 0, 0, 0}); math.Abs(got-0.25) > 1e-12 {
		t.Errorf("jain(one takes all of 4) = %v, want 0.25", got)
	}
}

func TestHistogram(t *testing.T) {
	got := histogram([]int64{0, 1, 99, 100, 250}, 100, 300)
	if len(got) != 3 || got[0] != 3 || got[1] != 1 || got[2] != 1 {
		t.Errorf("histogram = %v, want [3 1 1]", got)
	}
}

func TestCallDelta(t *testing.T) {
	a := serverStats{Calls: map[string]int64{"evalsha": 10, "get": 10, "info": 3}}
	b := serverStats{Calls: map[string]int64{"evalsha": 20, "eval": 1, "get": 21, "set": 11, "info": 9, "client|setinfo": 4, "time": 11}}
	total, scripts := callDelta(a, b)
	if total != 10+1+11+11+11 || scripts != 11 {
		t.Errorf("callDelta = %d, %d; want 44, 11", total, scripts)
	}
	m := parseInfo("# Commandstats\r\ncmdstat_evalsha:calls=7,usec=70,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\nused_cpu_sys:1.5\r\n")
	if m["cmdstat_evalsha"] == "" || m["used_cpu_sys"] != "1.5" {
		t.Errorf("parseInfo = %v", m)
	}
}

func TestParseBench(t *testing.T) {
	out := "goos: linux\nBenchmarkAllow/jobthrottle_gcra-2   \t    5000\t     61234 ns/op\t         1.000 roundtrips/op\t    1568 B/op\t      31 allocs/op\nPASS\n"
	got := parseBench(out)
	if len(got) != 1 {
		t.Fatalf("parseBench = %v", got)
	}
	g := got[0]
	if g.Name != "BenchmarkAllow/jobthrottle_gcra" || g.N != 5000 || g.NsPerOp != 61234 || g.BytesPerOp != 1568 || g.AllocsPerOp != 31 || g.RTPerOp != 1 {
		t.Errorf("parseBench = %+v", g)
	}
}

// TestReport evaluates the targets and renders the report from a made-up
// run: every target is checked, and a miss names the scenario and margin.
func TestReport(t *testing.T) {
	gcra, _ := implByName("jobthrottle/gcra")
	xr, _ := implByName("x/time/rate")
	rr, _ := implByName("redis_rate")
	mk := func(im impl, rt, redisCPU, jitterUs float64) *scenarioResult {
		s := scenario{Impl: im, Rate: 200, Burst: 10, Waiters: 256, Procs: 1, Duration: 10 * time.Second}
		var ts []int64
		for i := range 2000 {
			ts = append(ts, int64(i)*int64(5*time.Millisecond))
		}
		r := analyse(s, 0, []*procResult{{Admissions: [][]int64{ts}, RoundTrips: int64(rt * 2000)}})
		r.RedisCPUms, r.JitterP99us = redisCPU, jitterUs
		return r
	}
	res := &runResult{Config: runConfig{Rate: 200, WindowBurst: 10}, Scenarios: []*scenarioResult{
		mk(gcra, 1.0, 50, 300), mk(rr, 3.0, 200, 900), mk(xr, 0, 0, 100),
	}}
	res.Targets = evaluate(res)
	byID := map[string]target{}
	for _, tg := range res.Targets {
		byID[tg.ID] = tg
	}
	if !byID["rt"].Met || !byID["redis_cpu"].Met || !byID["accuracy"].Met {
		t.Errorf("targets rt/redis_cpu/accuracy = %+v %+v %+v, want met", byID["rt"], byID["redis_cpu"], byID["accuracy"])
	}
	if j := byID["jitter"]; j.Met || len(j.Failures) != 1 || !strings.Contains(j.Failures[0], "3.00×") {
		t.Errorf("jitter target = %+v, want missed at 3.00×", j)
	}
	md := renderReport(res, "bench/results/x.json", "bench/results/x.png", "")
	for _, want := range []string{"## Targets", "jobthrottle/gcra", "missed (1 of 1)", "## Wait scenarios"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

func TestAlignedStart(t *testing.T) {
	for _, c := range []struct{ in, want int64 }{
		{1_000_000_000, 1_500_000_000}, {1_500_000_000, 1_500_000_000}, {1_500_000_001, 2_500_000_000}, {1_499_999_999, 1_500_000_000},
	} {
		if got := alignedStart(time.Unix(0, c.in)).UnixNano(); got != c.want {
			t.Errorf("alignedStart(%d) = %d, want %d", c.in, got, c.want)
		}
	}
}
