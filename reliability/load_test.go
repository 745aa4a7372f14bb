package reliability

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The short version runs in CI; run the long one by hand:
//
//	go test ./reliability -run TestLoad -v -load.procs 8 -load.concurrency 50 -load.duration 60s
var (
	loadProcs       = flag.Int("load.procs", 2, "TestLoad: worker processes (re-executions of this test binary)")
	loadConcurrency = flag.Int("load.concurrency", 10, "TestLoad: goroutines waiting in each worker process")
	loadDuration    = flag.Duration("load.duration", 5*time.Second, "TestLoad: how long the workers start new Waits")
)

const roleLoad = "load-worker"

// loadSubjects are the tenants the load spreads over.
var loadSubjects = []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d"}

// loadLimiters are the limiters every worker process builds: each
// algorithm alone, and a three-rule policy. Rule names are unique across
// limiters, so a key's last part names its rule.
func loadLimiters() [][]throttle.Rule {
	return [][]throttle.Rule{
		{{Name: "bucket", Algorithm: throttle.TokenBucket, Limit: throttle.PerSecond(100).WithBurst(10)}},
		{{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(150).WithBurst(15)}},
		{{Name: "fixed", Algorithm: throttle.FixedWindow, Limit: throttle.PerSecond(50)}},
		{{Name: "log", Algorithm: throttle.SlidingLog, Limit: throttle.PerSecond(40)}},
		{{Name: "window", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(60), Precision: 100 * time.Millisecond}},
		{
			{Name: "policy-gcra", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(25).WithBurst(5)},
			{Name: "policy-fixed", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 100, Period: 5 * time.Second}},
			{Name: "policy-window", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(20), Precision: 50 * time.Millisecond},
		},
	}
}

// loadReport is what a worker process reports.
type loadReport struct {
	Waits, Errors int
	FirstErrors   []string
	LatencyUs     []int64 // client-side round trip of each decision, µs (a sample)
}

// admissionHook records, for every decision Redis admitted, each rule's
// key and refund ticket: the ticket is a Redis time or window for every
// algorithm (see the Lua files), so the parent can check the limits on
// Redis's own clock. It also samples round-trip latencies.
type admissionHook struct {
	mu   sync.Mutex
	out  *bufio.Writer
	lat  []int64
	seen atomic.Int64
}

func (*admissionHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*admissionHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *admissionHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		start := time.Now()
		err := next(ctx, cmd)
		op := scriptOp(cmd)
		if op != "allow" && op != "reserve" {
			return err
		}
		n := h.seen.Add(1)
		reply, ok := cmd.(*redis.Cmd).Val().([]any)
		args := cmd.Args()
		nkeys, _ := args[2].(int)
		h.mu.Lock()
		defer h.mu.Unlock()
		if n%10 == 0 {
			h.lat = append(h.lat, time.Since(start).Microseconds())
		}
		if err != nil || !ok || len(reply) != 6+nkeys || reply[0] != int64(1) {
			return err
		}
		for i := range nkeys {
			fmt.Fprintf(h.out, "%s %v\n", args[3+i], reply[6+i])
		}
		return err
	}
}

// runLoadWorker is a worker process: concurrency goroutines, each on one
// of the limiters, Wait on a random subject, one Wait after another, until
// the duration has passed, each under a 10s deadline. Admissions go to
// outPath.
func runLoadWorker(addr, prefix, outPath string, concurrency int, d time.Duration) loadReport {
	var rep loadReport
	f, err := os.Create(outPath)
	if err != nil {
		rep.FirstErrors = append(rep.FirstErrors, err.Error())
		rep.Errors++
		return rep
	}
	defer f.Close()
	hook := &admissionHook{out: bufio.NewWriter(f)}
	rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: concurrency + 10})
	defer rdb.Close()
	rdb.AddHook(hook)
	var lims []*throttle.Limiter
	for _, rules := range loadLimiters() {
		l, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rules...)
		if err != nil {
			panic(err)
		}
		lims = append(lims, l)
	}
	ctx := context.Background()
	// Start together with the other workers.
	barrier := prefix + "barrier"
	want, _ := strconv.Atoi(os.Getenv("JT_LOAD_PROCS"))
	_ = rdb.Incr(ctx, barrier).Err()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		if n, _ := rdb.Get(ctx, barrier).Int(); n >= want {
			break
		}
	}
	end := time.Now().Add(d)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range concurrency {
		// Each goroutine sticks to one limiter, so a slow rule does not
		// starve the others of waiters: every rule stays saturated.
		lim := lims[i%len(lims)]
		wg.Go(func() {
			for time.Now().Before(end) {
				subject := loadSubjects[rand.IntN(len(loadSubjects))]
				wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				err := lim.Wait(wctx, subject)
				cancel()
				mu.Lock()
				rep.Waits++
				if err != nil {
					rep.Errors++
					if len(rep.FirstErrors) < 5 {
						rep.FirstErrors = append(rep.FirstErrors, err.Error())
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	hook.mu.Lock()
	_ = hook.out.Flush()
	rep.LatencyUs = hook.lat
	hook.mu.Unlock()
	return rep
}

// TestLoad runs -load.procs worker processes (re-executions of this test
// binary that Wait through the library; not asynq servers) with
// -load.concurrency goroutines each, for -load.duration, against one
// redis-server, on a mix of rules: a token bucket, a GCRA, the three
// windows, and a three-rule policy, over four subjects. It requires zero
// errors and checks every rule's limit in every window, on Redis's clock,
// from the refund tickets Redis returned with each admission (exact, no
// client timing involved): fixed windows hold at most Count per window;
// the sliding log at most Count in any Period; the sliding window at most
// Count over the buckets of any Period; the token bucket and GCRA (whose
// tickets are their exact times to act) at most Burst + Count admissions in
// any Period. It reports
// throughput per rule, Redis CPU, and the p50/p99 of command latency (Redis
// INFO latencystats, and round trips seen by the clients).
func TestLoad(t *testing.T) {
	if child() == roleLoad {
		conc, _ := strconv.Atoi(os.Getenv("JT_LOAD_CONCURRENCY"))
		d, _ := time.ParseDuration(os.Getenv("JT_LOAD_DURATION"))
		rep := runLoadWorker(os.Getenv("JT_REDIS_ADDR"), os.Getenv("JT_PREFIX"), os.Getenv("JT_LOAD_OUT"), conc, d)
		out, _ := json.Marshal(rep)
		fmt.Printf("\nREPORT %s\n", out)
		return
	}
	if child() != "" {
		t.Skip("child process of another test")
	}
	srv := redistest.Server(t)
	admin := srv.Client(t)
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	dir := t.TempDir()
	if err := admin.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	cpu0 := redisCPU(t, admin)
	wall0 := time.Now()

	type proc struct {
		out *syncBuffer
		err chan error
	}
	var procs []proc
	cctx, cancel := context.WithTimeout(ctx, *loadDuration+2*time.Minute)
	defer cancel()
	for i := range *loadProcs {
		cmd, out := childCommand(t, cctx, "TestLoad", roleLoad,
			"JT_REDIS_ADDR="+srv.Addr(), "JT_PREFIX="+prefix,
			"JT_LOAD_OUT="+filepath.Join(dir, fmt.Sprintf("admissions-%d", i)),
			"JT_LOAD_PROCS="+strconv.Itoa(*loadProcs),
			"JT_LOAD_CONCURRENCY="+strconv.Itoa(*loadConcurrency),
			"JT_LOAD_DURATION="+loadDuration.String())
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		p := proc{out: out, err: make(chan error, 1)}
		go func() { p.err <- cmd.Wait() }()
		procs = append(procs, p)
	}
	var total loadReport
	for i, p := range procs {
		if err := <-p.err; err != nil {
			t.Fatalf("worker %d: %v\n%s", i, err, p.out)
		}
		var rep loadReport
		found := false
		for line := range strings.Lines(p.out.String()) {
			if js, ok := strings.CutPrefix(strings.TrimSpace(line), "REPORT "); ok {
				if err := json.Unmarshal([]byte(js), &rep); err != nil {
					t.Fatal(err)
				}
				found = true
			}
		}
		if !found {
			t.Fatalf("worker %d printed no report:\n%s", i, p.out)
		}
		total.Waits += rep.Waits
		total.Errors += rep.Errors
		total.FirstErrors = append(total.FirstErrors, rep.FirstErrors...)
		total.LatencyUs = append(total.LatencyUs, rep.LatencyUs...)
	}
	wall := time.Since(wall0)
	cpu := redisCPU(t, admin) - cpu0

	// Admissions by rule and subject, from every worker.
	adm := map[string][]string{} // key -> tickets
	for i := range procs {
		f, err := os.Open(filepath.Join(dir, fmt.Sprintf("admissions-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			k, tk, _ := strings.Cut(sc.Text(), " ")
			adm[k] = append(adm[k], tk)
		}
		f.Close()
	}
	rules := map[string]throttle.Rule{}
	for _, rs := range loadLimiters() {
		for _, r := range rs {
			rules[r.Name] = r
		}
	}
	perRule := map[string]int{}
	for key, tickets := range adm {
		name := key[strings.LastIndex(key, "}:")+2:]
		rule, ok := rules[name]
		if !ok {
			t.Fatalf("admission on unknown key %q", key)
		}
		perRule[name] += len(tickets)
		if worst, limit, ok := checkWindows(t, rule, tickets); !ok {
			t.Errorf("%s on %s: %d admissions in one window; the limit allows %d", name, key, worst, limit)
		}
	}

	lat := slices.Clone(total.LatencyUs)
	slices.Sort(lat)
	p := func(q float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return time.Duration(lat[int(float64(len(lat)-1)*q)]) * time.Microsecond
	}
	stats, _ := admin.Info(ctx, "latencystats").Result()
	var evalsha string
	for line := range strings.Lines(stats) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "latency_percentiles_usec_evalsha:"); ok {
			evalsha = v
		}
	}
	cmdstats, _ := admin.Info(ctx, "commandstats").Result()
	var calls string
	for line := range strings.Lines(cmdstats) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:"); ok {
			calls = v
		}
	}
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range perRule {
			if !yield(n) {
				return
			}
		}
	})
	var thr []string
	for _, n := range names {
		thr = append(thr, fmt.Sprintf("%s %.0f/s", n, float64(perRule[n])/loadDuration.Seconds()/float64(len(loadSubjects))))
	}
	t.Logf("load: %d procs x %d goroutines for %v: %d Waits, %d errors", *loadProcs, *loadConcurrency, *loadDuration, total.Waits, total.Errors)
	t.Logf("admitted per subject (4 subjects): %s", strings.Join(thr, ", "))
	t.Logf("Redis CPU: %.2f s over %v wall (%.0f%% of one core); EVALSHA %s", cpu, wall.Round(time.Millisecond), 100*cpu/wall.Seconds(), calls)
	t.Logf("Redis EVALSHA latency (INFO latencystats, µs): %s", evalsha)
	t.Logf("client round trip per decision: p50 %v, p99 %v, max %v (%d samples)", p(0.5), p(0.99), p(1), len(lat))
	if total.Errors > 0 {
		t.Errorf("%d of %d Waits failed; want none. First: %v", total.Errors, total.Waits, total.FirstErrors)
	}
	if total.Waits == 0 || len(adm) == 0 {
		t.Fatal("no Wait was admitted")
	}
}

// redisCPU returns the seconds of CPU the server has used.
func redisCPU(t *testing.T, c *redis.Client) float64 {
	t.Helper()
	info, err := c.Info(context.Background(), "cpu").Result()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for line := range strings.Lines(info) {
		for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), f); ok {
				x, _ := strconv.ParseFloat(v, 64)
				sum += x
			}
		}
	}
	return sum
}

// checkWindows checks one rule's admissions on one key against its limit,
// on Redis's clock, from the refund tickets (see TestLoad). It returns the
// most admissions found in one window, what the rule allows there, and
// whether that holds.
func checkWindows(t *testing.T, r throttle.Rule, tickets []string) (worst, limit int, ok bool) {
	t.Helper()
	us := func(d time.Duration) float64 { return float64(d / time.Microsecond) }
	times := make([]float64, 0, len(tickets))
	parse := func(s string) float64 {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			t.Fatalf("%s: ticket %q: %v", r.Name, s, err)
		}
		return v
	}
	// mostWithin is the most times in any half-open span of length span.
	mostWithin := func(span float64) int {
		slices.Sort(times)
		most := 0
		for i := range times {
			j, _ := slices.BinarySearch(times, times[i]+span)
			most = max(most, j-i)
		}
		return most
	}
	switch r.Algorithm {
	case throttle.FixedWindow: // ticket: the window's index
		per := map[string]int{}
		for _, tk := range tickets {
			per[tk]++
			worst = max(worst, per[tk])
		}
		return worst, r.Limit.Count, worst <= r.Limit.Count
	case throttle.SlidingLog: // ticket: "<admission time µs>:<seq>"
		for _, tk := range tickets {
			at, _, _ := strings.Cut(tk, ":")
			times = append(times, parse(at))
		}
		worst = mostWithin(us(r.Limit.Period))
		return worst, r.Limit.Count, worst <= r.Limit.Count
	case throttle.SlidingWindow: // ticket: the start of the bucket (µs)
		per := map[float64]int{}
		for _, tk := range tickets {
			per[parse(tk)]++
		}
		starts := slices.Sorted(func(yield func(float64) bool) {
			for s := range per {
				if !yield(s) {
					return
				}
			}
		})
		// Every bucket whose start lies in (s - period, s] was counted by
		// each admission in bucket s.
		for i, s := range starts {
			sum := 0
			for j := i; j >= 0 && starts[j] > s-us(r.Limit.Period); j-- {
				sum += per[starts[j]]
			}
			worst = max(worst, sum)
		}
		return worst, r.Limit.Count, worst <= r.Limit.Count
	case throttle.TokenBucket, throttle.GCRA:
		// ticket: the exact time to act, "<w> <r>": w µs plus r / count
		// µs (count in lowest terms). The whole µs are enough here: a
		// window one µs short of a period only makes the count stricter.
		for _, tk := range tickets {
			w, _, _ := strings.Cut(tk, " ")
			times = append(times, parse(w))
		}
		worst = mostWithin(us(r.Limit.Period) - 1)
		limit = r.Limit.Burst + r.Limit.Count // GCRA's bound, every window of Period
		return worst, limit, worst <= limit
	}
	t.Fatalf("unknown algorithm %v", r.Algorithm)
	return 0, 0, false
}
