package main

import (
	"context"
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
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

// TestRedisWindows counts on Redis's absolute clock in µs: the whole
// seconds are those of Redis TIME, not of the run's start.
func TestRedisWindows(t *testing.T) {
	const s = int64(1_000_000)
	us := []int64{5*s - 10, 5*s - 1, 5 * s, 5*s + 1, 5*s + s/10, 6*s - 1, 6*s - 2 + s/2}
	m1, m100, aligned := redisWindows(us)
	if m1 != 5 || m100 != 4 || aligned != 4 {
		t.Errorf("redisWindows = %d, %d, %d; want 5, 4, 4", m1, m100, aligned)
	}
}

// TestDriverAdmission reads driver.lua's replies as a go-redis hook sees
// them: only an admitted allow or reserve counts, a reservation at its
// slot (now + delay), n permits at once.
func TestDriverAdmission(t *testing.T) {
	ctx := context.Background()
	cmd := func(name, op string, n any, reply any, err error) *redis.Cmd {
		c := redis.NewCmd(ctx, name, "0123abcd", 2, "jt:{a}:r", "jt:{a}:q", op, n, -1, "gcra", 200, 1_000_000, 10, "")
		c.SetVal(reply)
		if err != nil {
			c.SetErr(err)
		}
		return c
	}
	ok := []any{int64(1), int64(1), int64(3), int64(2500), int64(7000), int64(1_700_000_000_000_000), "1.7e15"}
	for _, c := range []struct {
		name string
		cmd  redis.Cmder
		at   int64
		n    int
		ok   bool
	}{
		{"reserve", cmd("evalsha", "reserve", 1, ok, nil), 1_700_000_000_002_500, 1, true},
		{"allow ignores delay", cmd("evalsha", "allow", 1, ok, nil), 1_700_000_000_000_000, 1, true},
		{"eval fallback, n=3", cmd("eval", "reserve", 3, ok, nil), 1_700_000_000_002_500, 3, true},
		{"denied", cmd("evalsha", "reserve", 1, []any{int64(0), int64(1), int64(0), int64(2500), int64(7000), int64(1)}, nil), 0, 0, false},
		{"refund", cmd("evalsha", "refund", 1, int64(1), nil), 0, 0, false},
		{"prepay", cmd("evalsha", "prepay", 1, ok, nil), 0, 0, false},
		{"error", cmd("evalsha", "reserve", 1, ok, redis.ErrClosed), 0, 0, false},
		{"short reply", cmd("evalsha", "allow", 1, ok[:5], nil), 0, 0, false},
		{"not a script", redis.NewStringCmd(ctx, "get", "allow", "1"), 0, 0, false},
	} {
		at, n, ok := driverAdmission(c.cmd)
		if at != c.at || n != c.n || ok != c.ok {
			t.Errorf("%s: driverAdmission = %d, %d, %v; want %d, %d, %v", c.name, at, n, ok, c.at, c.n, c.ok)
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

// TestWindowLimitOnRedisClock: a sliding log judged on Redis's clock
// passes at R even when the client saw R + 3 in a second, and fails at
// R + 1; a row without Redis times (a results file from before them)
// keeps the client-clock check and renders "—".
func TestWindowLimitOnRedisClock(t *testing.T) {
	log, _ := implByName("jobthrottle/sliding_log")
	s := scenario{Impl: log, Rate: 200, Burst: 10, Waiters: 8, Procs: 2, Duration: 2 * time.Second}
	mk := func(redisPerSecond int) *scenarioResult {
		// The client saw 203 in the first second: three replies of the
		// second batch came back early.
		var client, onRedis [][]int64
		for p := range 2 {
			var c, r []int64
			for i := p; i < 400; i += 2 {
				sec := int64(i / 200)
				c = append(c, sec*int64(time.Second)+int64(i%200)*int64(time.Millisecond))
				r = append(r, 1_000_000_000_000_000+sec*1_000_000+int64(i%200)*1000)
			}
			client, onRedis = append(client, c), append(onRedis, r)
		}
		client[0][100] = 999 * int64(time.Millisecond) // the second batch's first, early on the client
		client[0][101] = 999 * int64(time.Millisecond)
		client[1][100] = 999 * int64(time.Millisecond)
		if redisPerSecond > 200 {
			onRedis[0][100] = 1_000_000_000_000_000 + 999_999 // one crosses on Redis's clock too
		}
		var procs []*procResult
		for p := range 2 {
			procs = append(procs, &procResult{Admissions: [][]int64{client[p]}, RedisClock: true, RedisUs: onRedis[p]})
		}
		return analyse(s, 0, procs)
	}
	for _, c := range []struct {
		redis1s int
		met     bool
	}{{200, true}, {201, false}} {
		r := mk(c.redis1s)
		if !r.RedisClock || r.Max1sRedis != c.redis1s || r.Max1s != 203 {
			t.Fatalf("analyse: redis clock %v, max 1 s %d on Redis's clock, %d on the client's; want true, %d, 203", r.RedisClock, r.Max1sRedis, r.Max1s, c.redis1s)
		}
		got := evaluate(&runResult{Scenarios: []*scenarioResult{r}})
		for _, tg := range got {
			if tg.ID == "window_limit" && (tg.Met != c.met || !strings.Contains(tg.Worst, "on Redis's clock; 203 on the client's")) {
				t.Errorf("window_limit with %d on Redis's clock = %+v, want met %v", c.redis1s, tg, c.met)
			}
		}
	}

	// A permit without its Redis time (a Wait that failed after Redis
	// admitted it): no Redis-clock figures rather than ones about other
	// permits than the row's.
	short := analyse(s, 0, []*procResult{
		{Admissions: [][]int64{{0, 1}}, RedisClock: true, RedisUs: []int64{5}},
		{Admissions: [][]int64{{2}}, RedisClock: true, RedisUs: []int64{6}},
	})
	if short.RedisClock {
		t.Errorf("analyse with 2 Redis times for 3 permits: RedisClock = true, want false")
	}
	// The jitter lab's burner runs beside the scenario, admits nothing
	// and records no Redis time: the others' figures stand.
	burner := analyse(s, 0, []*procResult{{Admissions: [][]int64{{0, 1}}, RedisClock: true, RedisUs: []int64{5, 6}}, {}})
	if !burner.RedisClock || burner.Max1sRedis != 2 {
		t.Errorf("analyse beside a burner: RedisClock %v, max 1 s %d; want true, 2", burner.RedisClock, burner.Max1sRedis)
	}

	// A results file from before the Redis clock: no fields, so the old
	// check (R + 2 on the client's clock) and a "—" in the table.
	var old scenarioResult
	if err := json.Unmarshal([]byte(`{"impl":"jobthrottle/sliding_log","algorithm":"sliding_log","redis":true,"rate":200,"waiters":8,"procs":2,"max_1s":202,"bound_1s":200}`), &old); err != nil {
		t.Fatal(err)
	}
	res := &runResult{Scenarios: []*scenarioResult{&old}}
	res.Targets = evaluate(res)
	for _, tg := range res.Targets {
		if tg.ID == "window_limit" && (!tg.Met || !strings.Contains(tg.Worst, "on the client's clock")) {
			t.Errorf("window_limit from an old file = %+v, want met on the client's clock", tg)
		}
	}
	md := renderReport(res, "bench/results/old.json", "bench/results/old.png", "")
	if !strings.Contains(md, "| 202 / 200 | — |") {
		t.Errorf("report of an old file lacks the \"—\" for max 1 s on Redis's clock")
	}
	if b, _ := json.Marshal(mk(200)); !strings.Contains(string(b), `"max_1s_redis":200`) {
		t.Errorf("JSON lacks max_1s_redis: %s", b)
	}
	if b, _ := json.Marshal(&old); strings.Contains(string(b), "redis_clock") || strings.Contains(string(b), "max_1s_redis") {
		t.Errorf("JSON of a row without Redis times has the fields: %s", b)
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

// A report replacing BENCHMARKS.md must not drop a section written into
// the file by hand: droppedSections names each, and only those.
func TestDroppedSections(t *testing.T) {
	old := "# Benchmarks\n\n## Targets\n\n## Analysis\n\n### By hand, in notes.md\n\n## Method\n\n## Written into the file\n\ntext\n\n### Its subsection\n"
	md := "# Benchmarks\n\n## Targets\n\n## Analysis\n\n### By hand, in notes.md\n\n## Method\n\n## Generated later\n"
	got := droppedSections(old, md)
	if want := []string{"## Written into the file", "### Its subsection"}; !slices.Equal(got, want) {
		t.Fatalf("droppedSections = %q, want %q", got, want)
	}
	if got := droppedSections(md, md); len(got) != 0 {
		t.Fatalf("a report dropping nothing: %q", got)
	}
}
