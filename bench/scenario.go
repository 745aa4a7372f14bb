package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// scenario is one Wait benchmark: an implementation, a limit, and W waiting
// goroutines spread over P processes that share one fresh key.
type scenario struct {
	Impl     impl
	Rate     int
	Burst    int
	Waiters  int // in total
	Procs    int
	Duration time.Duration
	// Burners, if above 0, runs a process of that many spinning goroutines
	// beside the scenario (the jitter lab's loaded condition).
	Burners int
}

func (s scenario) String() string {
	return fmt.Sprintf("%s R=%d burst=%d W=%d P=%d %v", s.Impl.Name, s.Rate, s.Burst, s.Waiters, s.Procs, s.Duration)
}

// scenarioResult holds every figure of one scenario; all of it goes to the
// JSON file and the table.
type scenarioResult struct {
	Impl         string  `json:"impl"`
	Algorithm    string  `json:"algorithm"`
	Redis        bool    `json:"redis"`
	Rate         int     `json:"rate"`
	Burst        int     `json:"burst"`
	BurstApplies bool    `json:"burst_applies"`
	Waiters      int     `json:"waiters"`
	Procs        int     `json:"procs"`
	DurationS    float64 `json:"duration_s"`

	// Admitted counts every permit, including those of the Waits still
	// outstanding at the end, which are let finish (the drain); AdmittedRun
	// counts those in [0, D), against ExpectedRun = R·D (+ burst for the
	// buckets).
	Admitted    int `json:"admitted"`
	AdmittedRun int `json:"admitted_run"`
	ExpectedRun int `json:"expected_run"`
	// SteadyRate is permits per second in [1 s, D), past the start-up
	// burst; Accuracy is SteadyRate / R.
	SteadyRate float64 `json:"steady_rate"`
	Accuracy   float64 `json:"accuracy"`
	// The most permits in any sliding window of 1 s and 100 ms over the
	// whole run, and the bounds R + burst and R/10 + burst (R and R/10 for
	// windows). MaxAligned1s is the most in one whole wall-clock second.
	Max1s    int `json:"max_1s"`
	Bound1s  int `json:"bound_1s"`
	Max100ms int `json:"max_100ms"`
	// Max990ms is the most in any 990 ms window: a window algorithm's
	// excess over R in 1 s that vanishes here comes from ≤ 10 ms of skew
	// between when Redis admitted a permit and when Wait returned.
	Max990ms     int `json:"max_990ms"`
	Bound100ms   int `json:"bound_100ms"`
	MaxAligned1s int `json:"max_aligned_1s"`
	// The same counts on Redis's clock, over the admission times the
	// library's scripts returned (redisclock.go), if RedisClock:
	// jobthrottle only, and only when every permit admitted has one. The
	// window limits are promises about these times; the figures above add
	// the client's return latency, which can carry a permit across a
	// window's edge. MaxAligned1sRedis counts whole seconds of Redis time,
	// the windows a fixed window of 1 s counts in.
	RedisClock        bool `json:"redis_clock,omitempty"`
	Max1sRedis        int  `json:"max_1s_redis,omitempty"`
	Max100msRedis     int  `json:"max_100ms_redis,omitempty"`
	MaxAligned1sRedis int  `json:"max_aligned_1s_redis,omitempty"`

	RoundTrips       int64   `json:"round_trips"`
	RTPerPermit      float64 `json:"rt_per_permit"`
	ServerCmds       int64   `json:"server_cmds"`
	CmdsPerPermit    float64 `json:"cmds_per_permit"`
	ServerScripts    int64   `json:"server_scripts"`
	ScriptsPerPermit float64 `json:"scripts_per_permit"`

	JitterP50us float64 `json:"jitter_p50_us"`
	JitterP99us float64 `json:"jitter_p99_us"`
	WaitP50ms   float64 `json:"wait_p50_ms"`
	WaitP99ms   float64 `json:"wait_p99_ms"`
	WaitMaxms   float64 `json:"wait_max_ms"`

	FairMin int     `json:"fair_min"`
	FairMax int     `json:"fair_max"`
	Jain    float64 `json:"jain"`

	ClientCPUms float64 `json:"client_cpu_ms_per_1000"`
	RedisCPUms  float64 `json:"redis_cpu_ms_per_1000"`

	LateStartMs float64 `json:"late_start_ms"` // worst child lateness past the barrier
	// Noise on the machine while the scenario ran: how late a 1 ms sleep
	// in the parent woke (p99 and max), and the 1-minute load average at
	// the start. Attempts is how many times the scenario's group ran (a
	// noisy group is rerun while the time budget allows; the quietest run
	// is kept).
	TimerLateP99us float64 `json:"timer_late_p99_us"`
	TimerLateMaxms float64 `json:"timer_late_max_ms"`
	Load1          float64 `json:"load1"`
	Attempts       int     `json:"attempts"`
	Errors         int64   `json:"errors"`
	FirstError     string  `json:"first_error,omitempty"`
	// Series100ms counts admissions per 100 ms from the start.
	Series100ms []int `json:"series_100ms"`
}

// runner starts children and reads the server around them.
type runner struct {
	exe  string
	srv  *redisServer
	rdb  *redis.Client // the harness's own connection
	logf func(string, ...any)
	seq  int
}

// warmScripts runs one Allow of every Redis-backed implementation on a
// throwaway key, so that the server has every script cached before any
// scenario: otherwise the first scenario of each script pays a NOSCRIPT
// miss and an EVAL per concurrent caller, once per server lifetime.
func warmScripts(ctx context.Context, rdb redis.UniversalClient) error {
	for _, im := range impls {
		if !im.Redis {
			continue
		}
		w, err := im.New(rdb, 200, 10)
		if err != nil {
			return err
		}
		al, ok := w.(Allower)
		if !ok {
			continue // mennanov/leaky_bucket: its lock is a script, loaded on first use
		}
		if _, err := al.Allow(ctx, "warm-up"); err != nil {
			return fmt.Errorf("bench: warm up %s: %w", im.Name, err)
		}
	}
	return nil
}

// lead is how far ahead of now the children's common start is set: time
// to exec, connect and open their pools.
const lead = 1500 * time.Millisecond

// alignedStart returns the first time at or after t that lies half-way
// through a wall-clock second. A fixed window's refills then fall at
// x.5 s from the start, never on the edge of the [1 s, D) span that the
// steady rate is counted over.
func alignedStart(t time.Time) time.Time {
	sec := time.Second.Nanoseconds()
	n := t.UnixNano() - sec/2
	k := floorDiv(n+sec-1, sec)
	return time.Unix(0, k*sec+sec/2)
}

// spawn runs one child per workload and returns their results.
func (r *runner) spawn(ws []workload) ([]*procResult, error) {
	return spawnChildren(r.exe, ws, nil)
}

// spawnChildren runs exe -child once per workload and returns their
// results. If killAt[i] is set, child i is killed (SIGKILL) then, and its
// result is nil.
func spawnChildren(exe string, ws []workload, killAt []time.Time) ([]*procResult, error) {
	type proc struct {
		cmd            *exec.Cmd
		stdout, stderr bytes.Buffer
	}
	killed := func(i int) bool { return i < len(killAt) && !killAt[i].IsZero() }
	procs := make([]*proc, len(ws))
	for i, w := range ws {
		spec, err := json.Marshal(w)
		if err != nil {
			return nil, err
		}
		p := &proc{cmd: exec.Command(exe, "-child", string(spec))}
		p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
		if err := p.cmd.Start(); err != nil {
			for _, q := range procs[:i] {
				q.cmd.Process.Kill()
				q.cmd.Wait()
			}
			return nil, fmt.Errorf("bench: start child: %w", err)
		}
		procs[i] = p
	}
	for i, p := range procs {
		if killed(i) {
			time.AfterFunc(time.Until(killAt[i]), func() { p.cmd.Process.Kill() })
		}
	}
	var firstErr error
	out := make([]*procResult, len(ws))
	for i, p := range procs {
		if err := p.cmd.Wait(); killed(i) {
			continue
		} else if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("bench: child %d: %v\n%s", i, err, tail(p.stderr.String(), 2000))
			continue
		}
		var res procResult
		if err := json.Unmarshal(p.stdout.Bytes(), &res); err != nil && firstErr == nil {
			firstErr = fmt.Errorf("bench: child %d output: %v\n%s", i, err, tail(p.stderr.String(), 2000))
			continue
		}
		out[i] = &res
	}
	return out, firstErr
}

// runScenario runs s in P children on a fresh key and measures it.
func (r *runner) runScenario(ctx context.Context, s scenario) (*scenarioResult, error) {
	r.seq++
	key := fmt.Sprintf("wait-%d-%d", time.Now().UnixNano(), r.seq)
	addr := ""
	if s.Impl.Redis {
		addr = r.srv.Addr
	}
	start := alignedStart(time.Now().Add(lead + time.Duration(s.Procs)*100*time.Millisecond))
	ws := make([]workload, s.Procs)
	for i := range ws {
		n := s.Waiters / s.Procs
		if i < s.Waiters%s.Procs {
			n++
		}
		ws[i] = workload{Mode: "wait", Impl: s.Impl.Name, Addr: addr, Rate: s.Rate, Burst: s.Burst,
			Waiters: n, Key: key, StartUnixNano: start.UnixNano(), Duration: s.Duration}
	}
	if s.Burners > 0 {
		ws = append(ws, workload{Mode: "burn", Waiters: s.Burners, StartUnixNano: start.UnixNano(),
			Duration: s.Duration + time.Duration(s.Waiters)*time.Second/time.Duration(s.Rate) + time.Second})
	}
	before, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	load := load1()
	stop := make(chan struct{})
	late := make(chan []int64)
	go canary(start, stop, late)
	procs, err := r.spawn(ws)
	close(stop)
	lateness := <-late
	if err != nil {
		return nil, err
	}
	after, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	res := analyse(s, start.UnixNano(), procs)
	res.Load1 = load
	res.TimerLateP99us = us(percentile(lateness, 99))
	if len(lateness) > 0 {
		res.TimerLateMaxms = ms(lateness[len(lateness)-1])
	}
	if s.Impl.Redis {
		total, scripts := callDelta(before, after)
		res.ServerCmds, res.ServerScripts = total, scripts
		if res.Admitted > 0 {
			res.CmdsPerPermit = float64(total) / float64(res.Admitted)
			res.ScriptsPerPermit = float64(scripts) / float64(res.Admitted)
			res.RedisCPUms = (after.CPU - before.CPU) * 1000 / float64(res.Admitted) * 1000
		}
	}
	return res, nil
}

// analyse merges the processes' reports into the scenario's figures.
func analyse(s scenario, startUnixNano int64, procs []*procResult) *scenarioResult {
	d := s.Duration.Nanoseconds()
	sec := time.Second.Nanoseconds()
	burst := s.Burst
	if s.Impl.Window {
		burst = 0
	}
	res := &scenarioResult{
		Impl: s.Impl.Name, Algorithm: s.Impl.Algorithm, Redis: s.Impl.Redis,
		Rate: s.Rate, Burst: s.Burst, BurstApplies: !s.Impl.Window,
		Waiters: s.Waiters, Procs: s.Procs, DurationS: s.Duration.Seconds(),
		ExpectedRun: int(int64(s.Rate)*d/sec) + burst,
		Bound1s:     s.Rate + burst,
		Bound100ms:  s.Rate/10 + burst,
	}
	var all, waits, onRedis []int64
	var perWaiter []int
	var cpu int64
	// Some process recorded Redis times (the jitter lab's burner, beside
	// the scenario, admits nothing and records none); the count below
	// checks that they cover every permit.
	redisClock := false
	for _, p := range procs {
		redisClock = redisClock || p.RedisClock
		onRedis = append(onRedis, p.RedisUs...)
		for _, a := range p.Admissions {
			all = append(all, a...)
			perWaiter = append(perWaiter, countBelow(a, d))
		}
		waits = append(waits, p.WaitNs...)
		res.RoundTrips += p.RoundTrips
		cpu += p.CPUNs
		res.Errors += p.Errors
		if res.FirstError == "" {
			res.FirstError = p.FirstError
		}
		res.LateStartMs = max(res.LateStartMs, ms(p.LateNs))
	}
	slices.Sort(all)
	slices.Sort(waits)
	res.Admitted = len(all)
	res.AdmittedRun = countIn(all, 0, d)
	if d > sec {
		res.SteadyRate = float64(countIn(all, sec, d)) / (s.Duration.Seconds() - 1)
	} else {
		res.SteadyRate = float64(res.AdmittedRun) / s.Duration.Seconds()
	}
	res.Accuracy = res.SteadyRate / float64(s.Rate)
	res.Max1s = maxInWindow(all, sec)
	res.Max100ms = maxInWindow(all, sec/10)
	res.Max990ms = maxInWindow(all, sec*99/100)
	res.MaxAligned1s = maxAligned(all, startUnixNano, sec)
	// A count that differs from the client's means a Wait failed after
	// Redis admitted it, or a process or decision went unrecorded: the
	// figures would then be about other permits than the rest of the row.
	if redisClock && len(onRedis) == len(all) {
		slices.Sort(onRedis)
		res.RedisClock = true
		res.Max1sRedis, res.Max100msRedis, res.MaxAligned1sRedis = redisWindows(onRedis)
	}

	ideal := sec / int64(s.Rate)
	lo := int64(0)
	if d > sec {
		lo = sec
	}
	j := jitter(all, lo, d, ideal)
	res.JitterP50us, res.JitterP99us = us(percentile(j, 50)), us(percentile(j, 99))
	res.WaitP50ms, res.WaitP99ms = ms(percentile(waits, 50)), ms(percentile(waits, 99))
	if len(waits) > 0 {
		res.WaitMaxms = ms(waits[len(waits)-1])
	}
	if len(perWaiter) > 0 {
		res.FairMin, res.FairMax = slices.Min(perWaiter), slices.Max(perWaiter)
		res.Jain = jain(perWaiter)
	}
	if res.Admitted > 0 {
		res.RTPerPermit = float64(res.RoundTrips) / float64(res.Admitted)
		res.ClientCPUms = ms(cpu) / float64(res.Admitted) * 1000
	}
	end := d + sec/2
	if len(all) > 0 {
		end = max(end, all[len(all)-1]+1)
	}
	res.Series100ms = histogram(all, sec/10, end)
	return res
}

// canary measures the machine's scheduling noise from start until stop:
// how much later than asked a 1 ms sleep returns, sorted.
func canary(start time.Time, stop <-chan struct{}, out chan<- []int64) {
	var late []int64
	time.Sleep(time.Until(start))
	for {
		select {
		case <-stop:
			slices.Sort(late)
			out <- late
			return
		default:
		}
		t := time.Now()
		time.Sleep(time.Millisecond)
		late = append(late, (time.Since(t) - time.Millisecond).Nanoseconds())
	}
}

// countBelow counts the values of ascending xs below limit.
func countBelow(xs []int64, limit int64) int {
	n := 0
	for _, x := range xs {
		if x < limit {
			n++
		}
	}
	return n
}
