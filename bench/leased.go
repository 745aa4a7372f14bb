package main

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// The leased part (go run . -leased, issue 14): one hot key, several
// processes, the plain path (one script call per permit) against
// throttle.Options.LocalLease and redis_rate, on one throwaway
// redis-server in one run. Each child records the moment every Wait or
// Allow returned admitted (wall clock, which on one machine is the clock
// redis-server's TIME reads) in a memory-mapped file, so that a child the
// parent kills with SIGKILL leaves every admission it made. Figures: the
// permits per second over the steady span [1 s, D), the most admitted in
// any sliding 1 s and 100 ms, redis-server CPU (INFO used_cpu_user +
// used_cpu_sys) and script calls per permit, client CPU per permit, and
// Jain's index over the processes.

// leasedConfig is the part's setup.
type leasedConfig struct {
	Rate      int     `json:"rate"`  // the hot key's limit, per second
	Burst     int     `json:"burst"` // its burst
	LeaseMs   float64 `json:"local_lease_ms"`
	Procs     int     `json:"procs"`
	Waiters   int     `json:"goroutines_per_proc"`
	DurationS float64 `json:"duration_s"`
	// The fallback check: Procs processes, one goroutine each asking
	// LowRate times a second, one permit at a time, for LowS seconds.
	LowRate int     `json:"low_rate_per_proc"`
	LowS    float64 `json:"low_s"`
	// Burners, if above 0, runs a process of that many spinning
	// goroutines through the whole part, as another session's work
	// (-leased-burn): the load of a busy machine.
	Burners int `json:"burners,omitempty"`
	// BurnSame runs the burners in the bench's session at its priority
	// (-leased-burn-same), not as another session's work.
	BurnSame bool `json:"burn_same,omitempty"`
	// Cases, if set, runs only the cases whose name matches it
	// (-leased-cases), and skips the fallback check unless it matches
	// "low rate".
	Cases string `json:"cases,omitempty"`
	// Out names the results file: results/<date>-<Out>.json (-leased-out;
	// default leased).
	Out string `json:"-"`
}

func defaultLeasedConfig() leasedConfig {
	return leasedConfig{Rate: 200_000, Burst: 200, LeaseMs: 5, Procs: 4, Waiters: 32, DurationS: 10, LowRate: 5, LowS: 4}
}

// leasedCase is one row: an implementation, an operation, a fleet.
type leasedCase struct {
	Name     string   `json:"name"`
	Impl     string   `json:"impl"`
	Op       string   `json:"op"` // wait, or allow (sleeping RetryAfter after a denial)
	LeaseMs  float64  `json:"local_lease_ms,omitempty"`
	Events   []string `json:"events,omitempty"` // joins, leaves, kills
	Admitted int      `json:"admitted"`
	SteadyPS float64  `json:"steady_permits_per_s"`
	PerProc  []int    `json:"per_proc"`
	Jain     float64  `json:"jain,omitempty"` // over processes that ran the whole time
	Max1s    int      `json:"max_1s"`
	Max100ms int      `json:"max_100ms"`
	Over1s   int      `json:"over_1s"` // Max1s - rate
	OverPct  float64  `json:"over_1s_pct"`
	Bound1s  int      `json:"bound_1s"` // burst + rate × (1 s + LocalLease): the documented bound
	// AfterKill1s is what the key admitted in the second after a child
	// was killed (churn only): the rate, less what the dead one held.
	AfterKill1s int              `json:"after_kill_1s,omitempty"`
	RedisCPU    float64          `json:"redis_cpu_us_per_permit"`
	Scripts     float64          `json:"scripts_per_permit"`
	ClientCPU   float64          `json:"client_cpu_us_per_permit"`
	Series      []int            `json:"series_100ms"`
	Ops         map[string]int64 `json:"script_ops,omitempty"` // the driver's ops, by name; killed children's uncounted
	Errors      int64            `json:"errors"`
	FirstErr    string           `json:"first_error,omitempty"`
	// Load is the 1-minute load average at the end of the case.
	Load float64 `json:"load_1m"`
	// Lease is the children's own record of their leases and scheduler
	// (leased_probe.go), every process together.
	Lease *leaseStats `json:"lease,omitempty"`
}

// leasedLow is the fallback check's result.
type leasedLow struct {
	Admitted int              `json:"admitted"`
	Scripts  int64            `json:"scripts"` // on the server (INFO commandstats)
	Ops      map[string]int64 `json:"script_ops"`
}

type leasedRun struct {
	Date     string        `json:"date"`
	Command  string        `json:"command"`
	RuntimeS float64       `json:"runtime_s"`
	Machine  machine       `json:"machine"`
	Library  library       `json:"library"`
	Config   leasedConfig  `json:"config"`
	OffsetUs float64       `json:"redis_minus_wall_us"` // Redis TIME less the wall clock, at the fastest TIME call
	Cases    []*leasedCase `json:"cases"`
	Low      *leasedLow    `json:"low_rate"`
}

// hotChild is one child of a case: when it starts and stops, relative to
// the case's start, and whether it is killed at its stop.
type hotChild struct {
	from, to time.Duration
	killed   bool
	linger   time.Duration // stays alive this long after to (a graceful leave)
}

// runLeasedPart runs every case on a fresh redis-server and writes
// results/<date>-leased.json, its plot, and the report.
func runLeasedPart(cfg leasedConfig, mdPath string, logf func(string, ...any)) error {
	t0 := time.Now()
	srv, err := startRedis(logf)
	if err != nil {
		return err
	}
	defer srv.Stop()
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "jobthrottle-leased-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	run := &leasedRun{Date: t0.UTC().Format(time.RFC3339), Command: "cd bench && go run . " + strings.Join(os.Args[1:], " "),
		Machine: readMachine(), Library: readLibrary(), Config: cfg}
	run.Machine.RedisVersion = srv.version
	run.Machine.LoadStart = loadavg()
	run.OffsetUs = redisOffset(ctx, rdb)
	d := time.Duration(cfg.DurationS * float64(time.Second))
	lease := time.Duration(cfg.LeaseMs * float64(time.Millisecond))
	steady := make([]hotChild, cfg.Procs)
	for i := range steady {
		steady[i] = hotChild{to: d}
	}
	// Churn: two for the whole run; one joins at 30 % and leaves at 75 %
	// (stops asking, stays 500 ms, exits); one is killed at 50 %; one
	// joins at 60 %.
	pct := func(p int) time.Duration { return d * time.Duration(p) / 100 }
	churn := []hotChild{{to: d}, {to: d}, {from: pct(30), to: pct(75), linger: 500 * time.Millisecond},
		{to: pct(50), killed: true}, {from: pct(60), to: d}}
	churnEvents := []string{"processes 1, 2 and 4 from the start", "process 3 joins at 30 %", "process 4 killed (SIGKILL) at 50 %",
		"process 5 joins at 60 %", "process 3 leaves at 75 %"}
	cases := []struct {
		c        leasedCase
		children []hotChild
	}{
		{leasedCase{Name: "jobthrottle/gcra, plain Wait", Impl: "jobthrottle/gcra", Op: "wait"}, steady},
		{leasedCase{Name: "jobthrottle/gcra, plain Allow (batched)", Impl: "jobthrottle/gcra", Op: "allow"}, steady},
		{leasedCase{Name: "redis_rate Allow", Impl: "redis_rate", Op: "allow"}, steady},
		{leasedCase{Name: "jobthrottle/gcra, leased Wait", Impl: "jobthrottle/gcra", Op: "wait", LeaseMs: cfg.LeaseMs}, steady},
		{leasedCase{Name: "jobthrottle/gcra, leased Allow", Impl: "jobthrottle/gcra", Op: "allow", LeaseMs: cfg.LeaseMs}, steady},
		{leasedCase{Name: "jobthrottle/gcra, leased Wait, churn", Impl: "jobthrottle/gcra", Op: "wait", LeaseMs: cfg.LeaseMs, Events: churnEvents}, churn},
	}
	match, err := regexp.Compile(cfg.Cases)
	if err != nil {
		return fmt.Errorf("bench: -leased-cases: %w", err)
	}
	stopBurners, err := leasedBurners(exe, cfg, logf)
	if err != nil {
		return err
	}
	defer stopBurners()
	for i, tc := range cases {
		if !match.MatchString(tc.c.Name) {
			continue
		}
		logf("leased: %s", tc.c.Name)
		c := tc.c
		ws := make([]workload, len(tc.children))
		key := fmt.Sprintf("hot-%d-%d", t0.UnixNano(), i)
		for j, ch := range tc.children {
			ws[j] = workload{Mode: "hot", Impl: c.Impl, Addr: srv.Addr, Rate: cfg.Rate, Burst: cfg.Burst, Waiters: cfg.Waiters,
				Key: key, Duration: ch.to - ch.from, HotOp: c.Op, LeaseNs: time.Duration(c.LeaseMs * float64(time.Millisecond)),
				File: filepath.Join(dir, fmt.Sprintf("case%d-proc%d", i, j)), Linger: ch.linger}
		}
		if err := runHotCase(ctx, exe, rdb, &c, tc.children, ws, cfg, lease, d); err != nil {
			return fmt.Errorf("bench: leased %s: %w", c.Name, err)
		}
		logLeasedCase(logf, &c)
		run.Cases = append(run.Cases, &c)
	}
	if match.MatchString("low rate") {
		low, err := runLowRate(ctx, exe, rdb, cfg, dir)
		if err != nil {
			return err
		}
		run.Low = low
		logf("leased: low rate: %d permits, %d script calls", low.Admitted, low.Scripts)
	}
	run.RuntimeS = time.Since(t0).Seconds()
	run.Machine.LoadEnd = loadavg()
	return writeLeasedRun(run, t0, cfg.Out, mdPath, logf)
}

// writeLeasedRun writes run to results/<date>-<out>.json (out: leased if
// empty) and its plot, then, for the report's own file (leased), the
// report.
func writeLeasedRun(run *leasedRun, t0 time.Time, out, mdPath string, logf func(string, ...any)) error {
	b, err := json.MarshalIndent(run, "", "  ")
	if err != nil {
		return err
	}
	out = cmp.Or(out, "leased")
	path := filepath.Join("results", t0.UTC().Format("2006-01-02")+"-"+out+".json")
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	logf("leased: wrote %s", path)
	if err := writeLeasedPlot(run, path); err != nil {
		return err
	}
	if out != "leased" {
		return nil // not the report's file
	}
	full, err := latestFullResults()
	if err != nil {
		return err
	}
	return regenerate(full, mdPath)
}

// runHotCase runs one case's children and fills in c.
func runHotCase(ctx context.Context, exe string, rdb *redis.Client, c *leasedCase, children []hotChild, ws []workload, cfg leasedConfig, lease, d time.Duration) error {
	start := time.Now().Add(lead)
	for j := range ws {
		ws[j].StartUnixNano = start.Add(children[j].from).UnixNano()
	}
	before, err := readStats(ctx, rdb)
	if err != nil {
		return err
	}
	killAt := make([]time.Time, len(children))
	for j, ch := range children {
		if ch.killed {
			killAt[j] = start.Add(ch.to)
		}
	}
	procs, err := spawnChildren(exe, ws, killAt)
	if err != nil {
		return err
	}
	after, err := readStats(ctx, rdb)
	if err != nil {
		return err
	}
	var all []int64
	var cpu int64
	for j, w := range ws {
		ts, err := readRecords(w.File)
		if err != nil {
			return err
		}
		off := children[j].from.Nanoseconds()
		for i := range ts {
			ts[i] += off
		}
		all = append(all, ts...)
		c.PerProc = append(c.PerProc, len(ts))
		if p := procs[j]; p != nil {
			c.add(p)
			cpu += p.CPUNs
		}
	}
	slices.Sort(all)
	sec := time.Second.Nanoseconds()
	c.Admitted = len(all)
	c.SteadyPS = float64(countIn(all, sec, d.Nanoseconds())) / (d.Seconds() - 1)
	c.Max1s, c.Max100ms = maxInWindow(all, sec), maxInWindow(all, sec/10)
	c.Over1s = c.Max1s - cfg.Rate
	c.OverPct = 100 * float64(c.Over1s) / float64(cfg.Rate)
	c.Bound1s = cfg.Burst + int(float64(cfg.Rate)*(time.Second+time.Duration(c.LeaseMs*float64(time.Millisecond))).Seconds())
	c.Series = histogram(all, sec/10, d.Nanoseconds()+sec/2)
	for _, ch := range children {
		if ch.killed {
			c.AfterKill1s = countIn(all, ch.to.Nanoseconds(), (ch.to + time.Second).Nanoseconds())
		}
	}
	whole := []int{}
	for j, ch := range children {
		if ch.from == 0 && ch.to == d && !ch.killed {
			whole = append(whole, c.PerProc[j])
		}
	}
	if len(whole) > 1 {
		c.Jain = jain(whole)
	}
	if c.Lease != nil {
		c.Lease.summarize()
		c.Lease.RTTs, c.Lease.Sleeps = nil, nil
	}
	c.Load = load1()
	if n := float64(max(c.Admitted, 1)); c.Admitted > 0 {
		c.RedisCPU = (after.CPU - before.CPU) * 1e6 / n
		_, scripts := callDelta(before, after)
		c.Scripts = float64(scripts) / n
		c.ClientCPU = float64(cpu) / 1e3 / n
	}
	return nil
}

// add counts a child's script calls, lease record and errors in c.
func (c *leasedCase) add(p *procResult) {
	for op, n := range p.ScriptOps {
		if c.Ops == nil {
			c.Ops = map[string]int64{}
		}
		c.Ops[op] += n
	}
	if p.Lease != nil {
		if c.Lease == nil {
			c.Lease = &leaseStats{}
		}
		c.Lease.merge(p.Lease)
	}
	c.Errors += p.Errors
	if c.FirstErr == "" {
		c.FirstErr = p.FirstError
	}
}

// readRecords reads a child's admission times (ns after its start; the
// file holds them plus 1, so that 0 is an unwritten place), sorted.
func readRecords(path string) ([]int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var ts []int64
	for i := 0; i+8 <= len(b); i += 8 {
		if v := int64(binary.LittleEndian.Uint64(b[i:])); v != 0 {
			ts = append(ts, v-1)
		}
	}
	slices.Sort(ts)
	return ts, nil
}

// redisOffset is Redis TIME less the wall clock, µs, read at the fastest of
// 20 TIME calls: on one machine, about 0 (one kernel clock), which the
// report shows as the check that times on the wall clock are on Redis's.
func redisOffset(ctx context.Context, rdb redis.UniversalClient) float64 {
	best, off := time.Duration(1<<62), 0.0
	for range 20 {
		a := time.Now()
		t, err := rdb.Time(ctx).Result()
		b := time.Now()
		if err != nil {
			continue
		}
		if rtt := b.Sub(a); rtt < best {
			mid := a.Add(rtt / 2)
			best, off = rtt, float64(t.Sub(mid).Nanoseconds())/1e3
		}
	}
	return off
}

// runLowRate is the fallback check: processes with LocalLease asking a few
// times a second, one permit at a time. Leased, they would make fewer script
// calls than permits; exact, they make one each.
func runLowRate(ctx context.Context, exe string, rdb *redis.Client, cfg leasedConfig, dir string) (*leasedLow, error) {
	d := time.Duration(cfg.LowS * float64(time.Second))
	ws := make([]workload, cfg.Procs)
	children := make([]hotChild, cfg.Procs)
	key := fmt.Sprintf("low-%d", time.Now().UnixNano())
	for j := range ws {
		ws[j] = workload{Mode: "hot", Impl: "jobthrottle/gcra", Addr: rdb.Options().Addr, Rate: cfg.Rate, Burst: cfg.Burst, Waiters: 1,
			Key: key, Duration: d, HotOp: "wait", LeaseNs: time.Duration(cfg.LeaseMs * float64(time.Millisecond)),
			PaceNs: time.Second / time.Duration(cfg.LowRate), File: filepath.Join(dir, fmt.Sprintf("low-proc%d", j))}
		children[j] = hotChild{to: d}
	}
	var c leasedCase
	if err := runHotCase(ctx, exe, rdb, &c, children, ws, cfg, 0, d); err != nil {
		return nil, err
	}
	low := &leasedLow{Admitted: c.Admitted, Scripts: int64(c.Scripts*float64(c.Admitted) + 0.5), Ops: c.Ops}
	return low, nil
}

// runHot is a "hot" child: Waiters goroutines ask for one permit of Key
// at a time, until Duration, recording every admission.
func runHot(w workload) (*procResult, error) {
	rdb := redis.NewClient(&redis.Options{Addr: w.Addr, PoolSize: max(2*w.Waiters, 20)})
	defer rdb.Close()
	var rt roundTrips
	rdb.AddHook(&rt)
	ops := &opHook{n: map[string]int64{}}
	rdb.AddHook(ops)
	probe := &leaseProbe{}
	rdb.AddHook(probe)
	ctx0 := context.Background()
	rdb.Ping(ctx0)
	capacity := int(float64(w.Rate)*(w.Duration.Seconds()+2)) + w.Burst + 1000
	rec, err := openRecorder(w.File, capacity)
	if err != nil {
		return nil, err
	}
	defer rec.close()
	var ask func(ctx context.Context) (bool, time.Duration, error)
	switch w.Impl {
	case "jobthrottle/gcra":
		lim, err := throttle.New(rdb, throttle.Options{Prefix: "jt:hot:", LocalLease: w.LeaseNs},
			throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(w.Rate).WithBurst(w.Burst)})
		if err != nil {
			return nil, err
		}
		if w.HotOp == "wait" {
			ask = func(ctx context.Context) (bool, time.Duration, error) { return true, 0, lim.Wait(ctx, w.Key) }
		} else {
			ask = func(ctx context.Context) (bool, time.Duration, error) {
				res, err := lim.Allow(ctx, w.Key)
				return res.Allowed, res.RetryAfter, err
			}
		}
	case "redis_rate":
		rr := newRedisRate(rdb, w.Rate, w.Burst)
		ask = func(ctx context.Context) (bool, time.Duration, error) {
			res, err := rr.l.Allow(ctx, w.Key, rr.limit)
			if err != nil {
				return false, 0, err
			}
			return res.Allowed > 0, res.RetryAfter, nil
		}
	default:
		return nil, fmt.Errorf("bench: hot: unknown implementation %q", w.Impl)
	}
	start := time.Unix(0, w.StartUnixNano)
	end := start.Add(w.Duration)
	ctx, cancel := context.WithDeadline(ctx0, end.Add(30*time.Second))
	defer cancel()
	res := &procResult{}
	if d := time.Until(start); d > 0 {
		time.Sleep(d)
	} else {
		res.LateNs = -d.Nanoseconds()
	}
	cpu0 := cpuTime()
	finish := probe.start(w)
	var mu sync.Mutex
	fail := func(err error) {
		mu.Lock()
		if res.Errors++; res.FirstError == "" {
			res.FirstError = err.Error()
		}
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for range w.Waiters {
		wg.Go(func() {
			for time.Now().Before(end) {
				ok, retry, err := ask(ctx)
				if err != nil {
					fail(err)
					if ctx.Err() != nil {
						return
					}
					continue
				}
				if !ok {
					time.Sleep(max(retry, time.Microsecond))
					continue
				}
				rec.add(time.Now().UnixNano() - w.StartUnixNano + 1)
				if w.PaceNs > 0 {
					time.Sleep(w.PaceNs)
				}
			}
		})
	}
	wg.Wait()
	res.CPUNs = cpuTime() - cpu0
	res.RoundTrips = rt.n.Load()
	res.Allowed = rec.n.Load()
	res.ScriptOps = ops.counts()
	res.Lease = finish()
	if w.Linger > 0 {
		time.Sleep(w.Linger)
	}
	return res, nil
}

// readLeased reads the newest results/*-leased.json.
func readLeased() (*leasedRun, string) {
	var run leasedRun
	path := readNewest("*-leased.json", &run)
	if path == "" {
		return nil, ""
	}
	return &run, path
}

// opHook counts a client's script calls by their first argument (the
// driver's op: allow, reserve, refund …; redis_rate's calls have none).
type opHook struct {
	mu sync.Mutex
	n  map[string]int64
}

func (h *opHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *opHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h *opHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h *opHook) count(cmd redis.Cmder) {
	if !isScript(cmd.Name()) {
		return
	}
	op := "other"
	args := cmd.Args()
	if nk, ok := asInt(args[2]); ok && len(args) > 3+nk {
		if s, ok := args[3+nk].(string); ok {
			op = s
		}
	}
	h.mu.Lock()
	h.n[op]++
	h.mu.Unlock()
}

func (h *opHook) counts() map[string]int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps.Clone(h.n)
}

// writeLeasedPlot draws admissions per 100 ms of every case beside
// <date>-leased.json, as <date>-leased.png.
func writeLeasedPlot(run *leasedRun, jsonPath string) error {
	var panels []plotSeries
	for _, c := range run.Cases {
		panels = append(panels, plotSeries{fmt.Sprintf("%s — %d processes", c.Name, len(c.PerProc)), c.Series})
	}
	return drawPanels(panels, float64(run.Config.Rate)/10,
		fmt.Sprintf("seconds from the start (a %g s run); dashed: the limit, %d per 100 ms", run.Config.DurationS, run.Config.Rate/10),
		strings.TrimSuffix(jsonPath, ".json")+".png")
}

// renderLeased is the report's section for the leased part.
func renderLeased(run *leasedRun, rel string) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c, m := run.Config, run.Machine
	find := func(name string) *leasedCase {
		for _, x := range run.Cases {
			if x.Name == name {
				return x
			}
		}
		return nil
	}
	plainWait, plainAllow, rr := find("jobthrottle/gcra, plain Wait"), find("jobthrottle/gcra, plain Allow (batched)"), find("redis_rate Allow")
	ceiling := 0.0
	for _, x := range []*leasedCase{plainWait, plainAllow, rr} {
		if x != nil {
			ceiling = max(ceiling, x.SteadyPS)
		}
	}
	p("\n## One hot key past one shard: leased permits (issue 14)\n\n")
	p("From [%s](%s): `%s`, %s (runtime %s), library at %s; %d CPUs, %s, redis-server %s; load average %s at the start, %s at the end (the machine is shared: other sessions built and tested on it meanwhile).\n\n",
		rel, rel, run.Command, run.Date, (time.Duration(run.RuntimeS) * time.Second).Round(time.Second), run.Library.Commit, m.NProc, m.GoVersion, m.RedisVersion, m.LoadStart, m.LoadEnd)
	p("One GCRA key limited to %d per second, burst %d, on one throwaway redis-server; %d processes (the bench re-executes itself) with %d goroutines each, asking one permit at a time for %g s, every case in the same run, back to back. **Plain Wait** reserves each permit in one script call; **plain Allow** is `Limiter.Allow` (concurrent calls pipelined, batch.go), sleeping `RetryAfter` after a denial; **redis_rate** is its `Allow` with the same loop; **leased** is the same `Limiter` with `Options{LocalLease: %gms}`. **Churn** is leased Wait with processes joining, leaving (they stop asking, their unused tail goes back, they exit) and one killed with SIGKILL. An admission is timed when `Wait` or `Allow` returned it, in the child, on the wall clock, and written to a memory-mapped file, so a killed child's admissions count too. On one machine that clock is the one redis-server's `TIME` reads (the fastest of 20 `TIME` calls put them %.0f µs apart, within its round trip), so the windows below are on the Redis clock, and they include every client's wake-up jitter: the plain path's slots are exact on the Redis clock, its return times are not. **Permits/s** is over the steady span [1 s, %g s); the **ceiling** is the best plain implementation's, measured in the same run; **Redis CPU** is the server's used_cpu_user + used_cpu_sys over the case, per permit; **bound** is burst + rate × (1 s + LocalLease), the documented one; **Jain** is over the processes that ran the whole case.\n\n",
		c.Rate, c.Burst, c.Procs, c.Waiters, c.DurationS, c.LeaseMs, math.Abs(run.OffsetUs), c.DurationS)
	p("| case | permits/s | × ceiling | most in any 1 s | over the limit | bound | most in any 100 ms | Redis CPU µs/permit | script calls/permit | client CPU µs/permit | Jain | per process |\n")
	p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
	for _, x := range run.Cases {
		jainCell := "—"
		if x.Jain > 0 {
			jainCell = fmt.Sprintf("%.4f", x.Jain)
		}
		bound := "—"
		if x.LeaseMs > 0 {
			bound = fmt.Sprintf("%d", x.Bound1s)
		}
		p("| %s | %.0f | %.2f | %d | %+d (%+.2f %%) | %s | %d | %.2f | %.4f | %.2f | %s | %s |\n",
			x.Name, x.SteadyPS, x.SteadyPS/max(ceiling, 1), x.Max1s, x.Over1s, x.OverPct, bound, x.Max100ms,
			x.RedisCPU, x.Scripts, x.ClientCPU, jainCell, joinInts(x.PerProc))
	}
	p("\n")
	if ch := find("jobthrottle/gcra, leased Wait, churn"); ch != nil {
		p("Churn: %s. In the second after the kill the key admitted %d (the limit: %d): what the dead process held and never used is lost, at most two of its leases.\n\n",
			strings.Join(ch.Events, "; "), ch.AfterKill1s, c.Rate)
	}
	for _, x := range run.Cases {
		if len(x.Ops) > 0 && x.LeaseMs > 0 {
			keys := slices.Sorted(maps.Keys(x.Ops))
			var parts []string
			for _, k := range keys {
				parts = append(parts, fmt.Sprintf("%s %d", k, x.Ops[k]))
			}
			p("- %s: script calls by op (the children's own count; a killed child's are not in it): %s.\n", x.Name, strings.Join(parts, ", "))
		}
	}
	if run.Low != nil {
		p("- Fallback: %d processes, one goroutine each asking %d times a second, one permit at a time, for %g s, with LocalLease: %d permits, %d script calls on the server (ops: %v): exact, one call per permit, no lease.\n",
			c.Procs, c.LowRate, c.LowS, run.Low.Admitted, run.Low.Scripts, run.Low.Ops)
	}
	lw, la := find("jobthrottle/gcra, leased Wait"), find("jobthrottle/gcra, leased Allow")
	if lw != nil && plainWait != nil && plainAllow != nil && la != nil && rr != nil {
		p("\nRatios in this run: leased Wait admits %.2f× the plain Wait's permits/s and %.2f× the one-shard ceiling (the best plain path, %.0f/s), at %.1f× less Redis CPU per permit than plain Wait, %.1f× less than plain Allow and %.1f× less than redis_rate; leased Allow, %.2f× the ceiling at %.1f× less Redis CPU per permit than plain Allow.\n",
			lw.SteadyPS/plainWait.SteadyPS, lw.SteadyPS/ceiling, ceiling, plainWait.RedisCPU/lw.RedisCPU, plainAllow.RedisCPU/lw.RedisCPU, rr.RedisCPU/lw.RedisCPU,
			la.SteadyPS/ceiling, plainAllow.RedisCPU/la.RedisCPU)
	}
	if lw != nil && la != nil && plainWait != nil && plainAllow != nil && run.Low != nil {
		ch := find("jobthrottle/gcra, leased Wait, churn")
		over := max(lw.OverPct, la.OverPct)
		if ch != nil {
			over = max(over, ch.OverPct)
		}
		best := max(lw.SteadyPS, la.SteadyPS)
		p("\nIssue 14's targets in this run: ≥ 100,000 permits/s on one key: %.0f (%s); ≥ 2.5× the one-shard ceiling: %.2f× (%s); Redis CPU per permit ≥ 10× below the plain path: leased Wait %.1f× below plain Wait, leased Allow %.1f× below plain Allow (%s); over-admission ≤ 1 %% of the limit in any 1 s window, with joins, leaves and a kill: at most %+.2f %% (%s); exact at low rates: %d script calls for %d permits (%s); Jain ≥ 0.99: %.4f and %.4f (%s).\n",
			best, metWord(best >= 100_000), best/ceiling, metWord(best >= 2.5*ceiling),
			plainWait.RedisCPU/lw.RedisCPU, plainAllow.RedisCPU/la.RedisCPU, metWord(plainWait.RedisCPU >= 10*lw.RedisCPU && plainAllow.RedisCPU >= 10*la.RedisCPU),
			over, metWord(over <= 1), run.Low.Scripts, run.Low.Admitted, metWord(run.Low.Scripts == int64(run.Low.Admitted)),
			lw.Jain, la.Jain, metWord(lw.Jain >= 0.99 && la.Jain >= 0.99))
	}
	p("\n![admissions per 100 ms, leased and plain](%s)\n", strings.TrimSuffix(rel, ".json")+".png")
	return b.String()
}

func metWord(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}
