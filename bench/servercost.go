package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The server-cost part counts the instructions redis-server executes per
// Allow under valgrind's callgrind. Allow throughput moves by ±15 % from
// round to round on a shared machine, because client and server compete
// for the CPU with whatever else runs; an instruction count does not
// depend on load, so it compares the scripts' cost where throughput cannot.
//
// Each case runs twice, serverCostLow and serverCostHigh calls, each on a
// fresh server, and the figure is the difference of the two totals over
// the difference of the calls: start-up, script loading, connection set-up
// and shutdown are the same in both runs and cancel. Under callgrind the
// server runs many times slower, so the calls come from one goroutine.
//
// What still depends on time is the keys' expiry, which is the limiters'
// design: their keys live for milliseconds of real time, and how many a
// call finds gone, and how many the server's active expiry cycle removes
// instead of the calls, changes with the calls' pace. Repeated runs, quiet
// or beside three busy loops at the same priority that made the calls 2.5
// times slower, agreed within about 300 instructions per call: 0.2–1.5 %
// for the limiters, 2 % for the control's 11 000 (redis_rate's moved by
// +1.0 % beside the loops, more work in activeExpireCycle, less in the
// scripts).
const (
	serverCostLow  = 1_000
	serverCostHigh = 6_000
	// serverCostReady is how long a server under valgrind may take to
	// answer PING.
	serverCostReady = 30 * time.Second
	// serverCostUncounted is the one server function whose instructions
	// are not counted: serverCron's gathering of jemalloc's statistics
	// every 100 ms, 1.2 million instructions a second under callgrind
	// whatever the server does. Counted, it made the figures depend on
	// wall time and so on load again: beside three busy loops a call took
	// 2.5 times as long and redis_rate's figure rose by 1.5 %. Without it
	// an idle server executes some 33 000 instructions a second. (If a
	// redis-server has no function of this name, nothing is left out.)
	serverCostUncounted = "cronUpdateMemoryStats"
)

// controlCost is the control case: a script that does nothing, run with
// EVALSHA like the limiters' scripts. Its cost is the floor of one script
// call: reading the command, finding the script, entering and leaving
// Lua, writing the reply.
const controlCost = "EVALSHA 'return 1'"

// serverCostResult is one case's redis-server instructions per call.
type serverCostResult struct {
	Impl string `json:"impl"`
	// Calls are the calls of the two runs, and Ir the total instructions
	// (callgrind's Ir) the server executed in each, from start to exit.
	Calls []int   `json:"calls"`
	Ir    []int64 `json:"ir"`
	// IrPerCall is (Ir[1] − Ir[0]) / (Calls[1] − Calls[0]).
	IrPerCall float64 `json:"ir_per_call"`
	// VsRedisRate is IrPerCall over redis_rate's (0 if it was not measured).
	VsRedisRate float64 `json:"vs_redis_rate,omitempty"`
	// CmdsPerCall is the server's commands per call in the longer run (INFO
	// commandstats: the EVALSHA and the commands its script ran), and
	// AllowedFrac the share of calls allowed there.
	CmdsPerCall float64 `json:"cmds_per_call"`
	AllowedFrac float64 `json:"allowed_frac"`
	// Seconds is each run's wall time for its calls, under valgrind: the
	// server's timer work (serverCron) is in Ir in proportion to it.
	Seconds []float64 `json:"seconds"`
}

// costCase is one thing whose server cost is measured.
type costCase struct {
	name string
	new  func(rdb redis.UniversalClient) (Allower, error)
}

// evalOne is the control: EVALSHA of `return 1` with no keys.
type evalOne struct {
	rdb    redis.UniversalClient
	script *redis.Script
}

func (e evalOne) Allow(ctx context.Context, _ string) (bool, error) {
	return true, e.script.Run(ctx, e.rdb, nil).Err()
}

// serverCostCases returns the control, then the implementations named, as
// Allowers with the limit rate/s and burst (the throughput part's).
func serverCostCases(names []string, rate, burst int) ([]costCase, error) {
	var cases []costCase
	for _, name := range names {
		if name == controlCost {
			script := redis.NewScript("return 1")
			cases = append(cases, costCase{name, func(rdb redis.UniversalClient) (Allower, error) {
				return evalOne{rdb, script}, nil
			}})
			continue
		}
		im, err := implByName(name)
		if err != nil {
			return nil, err
		}
		if !im.Redis {
			return nil, fmt.Errorf("bench: %s does not use Redis", name)
		}
		cases = append(cases, costCase{name, func(rdb redis.UniversalClient) (Allower, error) {
			w, err := im.New(rdb, rate, burst)
			if err != nil {
				return nil, err
			}
			al, ok := w.(Allower)
			if !ok {
				return nil, fmt.Errorf("bench: %s has no Allow", name)
			}
			return al, nil
		}})
	}
	return cases, nil
}

// serverCostNames is what the full run measures: the control and every
// Redis-backed implementation, in the impls table's order.
func serverCostNames() []string {
	names := []string{controlCost}
	for _, im := range impls {
		if im.Redis && im.Name != "mennanov/leaky_bucket" { // a queue: it has no Allow
			names = append(names, im.Name)
		}
	}
	return append(names, floorName)
}

// errNoValgrind says why the part cannot run.
var errNoValgrind = errors.New("valgrind is not on PATH (Debian package valgrind)")

// runServerCost measures every case named with calls[0] and calls[1] Allow
// calls on keys drawn from keys. A case that fails is left out and its
// error returned beside the others' results.
func runServerCost(ctx context.Context, names []string, rate, burst, keys int, calls [2]int, logf func(string, ...any)) ([]*serverCostResult, []error) {
	valgrind, err := exec.LookPath("valgrind")
	if err != nil {
		return nil, []error{fmt.Errorf("bench: server cost: %w", errNoValgrind)}
	}
	if calls[1] <= calls[0] {
		return nil, []error{fmt.Errorf("bench: server cost: calls %v must grow", calls)}
	}
	cases, err := serverCostCases(names, rate, burst)
	if err != nil {
		return nil, []error{err}
	}
	var out []*serverCostResult
	var errs []error
	for _, c := range cases {
		res := &serverCostResult{Impl: c.name, Calls: calls[:]}
		var runs [2]callgrindRun
		for i, n := range calls {
			if runs[i], err = runUnderCallgrind(ctx, valgrind, c, n, keys, logf); err != nil {
				break
			}
			res.Ir = append(res.Ir, runs[i].ir)
			res.Seconds = append(res.Seconds, runs[i].seconds)
		}
		if err != nil {
			err = fmt.Errorf("bench: server cost %s: %w", c.name, err)
			logf("%v", err)
			errs = append(errs, err)
			continue
		}
		res.IrPerCall = float64(res.Ir[1]-res.Ir[0]) / float64(calls[1]-calls[0])
		res.CmdsPerCall, res.AllowedFrac = runs[1].cmdsPerCall, runs[1].allowedFrac
		logf("server cost %-26s %8.0f Ir/call  cmds/call %.2f  allowed %.1f %%  (%d calls: %d Ir, %.1f s; %d calls: %d Ir, %.1f s)",
			c.name, res.IrPerCall, res.CmdsPerCall, res.AllowedFrac*100, calls[0], res.Ir[0], res.Seconds[0], calls[1], res.Ir[1], res.Seconds[1])
		out = append(out, res)
	}
	var peer float64
	for _, r := range out {
		if r.Impl == "redis_rate" {
			peer = r.IrPerCall
		}
	}
	if peer > 0 {
		for _, r := range out {
			r.VsRedisRate = r.IrPerCall / peer
		}
	}
	return out, errs
}

// callgrindRun is what one server under callgrind did.
type callgrindRun struct {
	ir          int64   // instructions, start to exit
	seconds     float64 // the calls' wall time
	cmdsPerCall float64
	allowedFrac float64
}

// runUnderCallgrind starts redis-server under callgrind, makes one Allow
// on a warm-up key (loading the script) and n on keys drawn from keys,
// shuts the server down and reads its instruction count. The keys are
// drawn from a fixed seed, so the shorter run's calls are the longer
// run's first.
func runUnderCallgrind(ctx context.Context, valgrind string, c costCase, n, keys int, logf func(string, ...any)) (callgrindRun, error) {
	var out string
	srv, err := startRedisUnder(logf, func(dir string) []string {
		out = filepath.Join(dir, "callgrind.out")
		return []string{valgrind, "--tool=callgrind", "--callgrind-out-file=" + out,
			// --toggle-collect alone would count only inside the function.
			"--toggle-collect=" + serverCostUncounted, "--collect-atstart=yes"}
	}, serverCostReady)
	if err != nil {
		return callgrindRun{}, err
	}
	defer srv.Stop()
	// No retries: a failed call is an error here, and SHUTDOWN, which
	// closes the connection instead of replying, would be retried on a
	// new one and log the refused dials.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	defer rdb.Close()
	al, err := c.new(rdb)
	if err != nil {
		return callgrindRun{}, err
	}
	if _, err := al.Allow(ctx, "server-cost-warm-up"); err != nil {
		return callgrindRun{}, fmt.Errorf("warm-up: %w", err)
	}
	before, err := readStats(ctx, rdb)
	if err != nil {
		return callgrindRun{}, err
	}
	r := rand.New(rand.NewPCG(1, 2))
	var allowed int
	t0 := time.Now()
	for range n {
		ok, err := al.Allow(ctx, "sc:"+strconv.Itoa(r.IntN(keys)))
		if err != nil {
			return callgrindRun{}, err
		}
		if ok {
			allowed++
		}
	}
	run := callgrindRun{seconds: time.Since(t0).Seconds(), allowedFrac: float64(allowed) / float64(n)}
	after, err := readStats(ctx, rdb)
	if err != nil {
		return callgrindRun{}, err
	}
	total, _ := callDelta(before, after)
	run.cmdsPerCall = float64(total) / float64(n)
	if err := srv.shutdownNoSave(ctx, rdb, time.Minute); err != nil {
		return callgrindRun{}, err
	}
	run.ir, err = callgrindTotal(out)
	return run, err
}

// shutdownNoSave sends SHUTDOWN NOSAVE and waits up to timeout for the
// process to exit (callgrind writes its counts as it exits), leaving the
// server's files for Stop to remove.
func (s *redisServer) shutdownNoSave(ctx context.Context, rdb *redis.Client, timeout time.Duration) error {
	// The server closes the connection instead of replying: the error
	// that follows says nothing, whether it exited is what counts.
	_ = rdb.ShutdownNoSave(ctx).Err()
	select {
	case <-s.done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("redis-server did not exit within %v of SHUTDOWN NOSAVE", timeout)
	}
}

// callgrindTotal reads the total instruction count from a callgrind output
// file: its totals: line, or failing that its summary: line (the first
// event, Ir, is the only one callgrind collects by default).
func callgrindTotal(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var summary, totals string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if v, ok := strings.CutPrefix(line, "totals:"); ok {
			totals = v
		} else if v, ok := strings.CutPrefix(line, "summary:"); ok {
			summary = v
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	v := totals
	if v == "" {
		v = summary
	}
	fields := strings.Fields(v)
	if len(fields) == 0 {
		return 0, fmt.Errorf("%s: no totals: or summary: line", path)
	}
	ir, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return ir, nil
}

// runServerCostPart is the run's server-cost part: every case with the
// config's calls, or a reduction saying why not.
func runServerCostPart(ctx context.Context, cfg runConfig, filter *regexp.Regexp, res *runResult, logf func(string, ...any)) {
	if len(cfg.ServerCostCalls) != 2 {
		why := "quick mode leaves it out (14 servers under valgrind, half a minute or more); -full runs it"
		logf("server cost: not measured: %s", why)
		res.Reductions = append(res.Reductions, "redis-server instructions per Allow (callgrind) are not measured: "+why+".")
		return
	}
	if _, err := exec.LookPath("valgrind"); err != nil {
		logf("server cost: not measured: %v", errNoValgrind)
		res.Reductions = append(res.Reductions, "redis-server instructions per Allow (callgrind) are not measured: "+errNoValgrind.Error()+".")
		return
	}
	t0 := time.Now()
	calls := [2]int{cfg.ServerCostCalls[0], cfg.ServerCostCalls[1]}
	logf("server cost: redis-server under callgrind, %d and %d Allow calls per implementation", calls[0], calls[1])
	names := serverCostNames()
	if filter != nil { // -impls: the control and the implementations it matches
		names = slices.DeleteFunc(names, func(n string) bool { return n != controlCost && !filter.MatchString(n) })
	}
	out, errs := runServerCost(ctx, names, cfg.Rate, throughputBurst, cfg.TPKeys, calls, logf)
	for _, err := range errs {
		res.Errors = append(res.Errors, err.Error())
	}
	res.ServerCost = out
	logf("server cost: done in %v", time.Since(t0).Round(time.Second))
}

// renderServerCost is the report's server-cost section, empty for a run
// (or an older results file) without it.
func renderServerCost(res *runResult) string {
	if len(res.ServerCost) == 0 {
		return ""
	}
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c := res.ServerCost[0].Calls
	p("\n## redis-server instructions per Allow (callgrind)\n\n")
	uncounted := ""
	if u := res.Config.ServerCostUncounted; u != "" {
		uncounted = fmt.Sprintf(", leaving out `%s`, the allocator statistics the server gathers ten times a second whatever it does", u)
	}
	p("Instructions redis-server executed per Allow, counted by valgrind's callgrind, which unlike Allow/s do not depend on the machine's load (repeated runs, quiet or beside busy loops that made the calls 2.5 times slower, agreed within about 300 per call): each implementation ran on two fresh servers, %d and %d calls from one goroutine (valgrind makes the server many times slower) on keys drawn from %d, limit %d/s, burst %d, after one call that loads the script, and the figure is the difference of the two runs' totals (in the results file) over the %d calls between them, which cancels start-up, script loading and shutdown%s.\n\n",
		c[0], c[1], res.Config.TPKeys, res.Config.Rate, throughputBurst, c[1]-c[0], uncounted)
	p("| implementation | Ir per call | vs redis_rate | server cmds/call | allowed |\n|---|---|---|---|---|\n")
	for _, r := range res.ServerCost {
		ratio := "–"
		if r.VsRedisRate > 0 {
			ratio = fmt.Sprintf("%.2f×", r.VsRedisRate)
		}
		p("| %s | %.0f | %s | %.2f | %.1f %% |\n", r.Impl, r.IrPerCall, ratio, r.CmdsPerCall, r.AllowedFrac*100)
	}
	return b.String()
}

// serverCostInfo is the line beside the throughput target: the bucket
// implementations' server instructions per Allow against redis_rate's,
// the load-independent view of the same comparison. It informs, it does
// not judge: the target is about throughput.
func serverCostInfo(rs []*serverCostResult) string {
	var parts []string
	var peer float64
	for _, r := range rs {
		if r.Impl == "redis_rate" {
			peer = r.IrPerCall
		}
	}
	for _, r := range rs {
		if in(r.Impl, bucketImpls) && r.VsRedisRate > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f = %.2f×", r.Impl, r.IrPerCall, r.VsRedisRate))
		}
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("redis-server instructions per Allow (callgrind; they do not depend on load): %s redis_rate's %.0f.", strings.Join(parts, ", "), peer)
}
