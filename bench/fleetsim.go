package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
)

// The fleet part (go run . -fleet, issue 25 item 3): a fleet of simulated
// workers (fleetsim_child.go) on a 3-master Redis Cluster the part starts,
// in three phases: idle (no task at all), memory (tasks parked and held,
// INFO memory before and after), and busy (a backlog over many tenants,
// parked and woken). It counts every command the workers' clients send,
// reads INFO commandstats, cpu and memory on each master around each phase,
// and writes results/<date>-fleet.json and its section of BENCHMARKS.md.

// fleetConfig is the part's setup; the defaults finish in about four
// minutes on two cores.
type fleetConfig struct {
	Workers     int     `json:"workers"`     // simulated worker processes
	Procs       int     `json:"procs"`       // OS processes they run in
	Concurrency int     `json:"concurrency"` // task slots per worker
	Shards      int     `json:"shards"`      // wake-up ledger shards
	IdleS       float64 `json:"idle_s"`
	SettleS     float64 `json:"settle_s"`
	fleetLoad
}

func defaultFleetConfig() fleetConfig {
	return fleetConfig{Workers: 1000, Procs: 4, Concurrency: 4, Shards: admission.DefaultWakeupShards, IdleS: 30, SettleS: 5,
		fleetLoad: fleetLoad{Tenants: 100_000, PerTenant: 2, Interval: 2 * time.Second, Arrival: 200 * time.Second, MemTenants: 20_000, LinedTenants: 2_000}}
}

// fleetProc is one fleet process and its command pipe.
type fleetProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	dec *json.Decoder
}

func (p *fleetProc) ask(cmd string, v any) error {
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		return err
	}
	return p.dec.Decode(v)
}

// simFleet is the running part: the cluster, the processes, a client per
// master for INFO.
type simFleet struct {
	cfg     fleetConfig
	cluster *simCluster
	procs   []*fleetProc
	nodes   map[string]*redis.Client
	ledger  []fleetShard
	logf    func(string, ...any)
}

// runFleetPart runs the part and writes its results and report section.
// Ctrl-C or an error stops the processes and the cluster it started.
func runFleetPart(logf func(string, ...any), cfg fleetConfig, mdPath string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	t0 := time.Now()
	res := &fleetResult{partHead: newPartHead(t0), Config: cfg}
	logf("fleet: starting a 3-master Redis Cluster (load %s)", res.Machine.LoadStart)
	cl, err := startSimCluster(ctx, 3, logf)
	if err != nil {
		return err
	}
	defer cl.Stop()
	res.Machine.RedisVersion = cl.Version
	f := &simFleet{cfg: cfg, cluster: cl, nodes: map[string]*redis.Client{}, logf: logf}
	for _, a := range cl.Addrs {
		f.nodes[a] = redis.NewClient(&redis.Options{Addr: a})
		defer f.nodes[a].Close()
	}
	if res.Ledger, err = f.ledgerNodes(ctx); err != nil {
		return err
	}
	f.ledger = res.Ledger
	defer f.kill()
	if err := f.startProcs(ctx); err != nil {
		return err
	}
	if err := f.phases(ctx, res); err != nil {
		if ctx.Err() != nil {
			return errors.New("bench: fleet: interrupted; the cluster and the fleet processes are stopped, no results written")
		}
		return err
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	res.Targets = fleetTargets(res)
	if err := writePart(logf, t0, "fleet", res); err != nil {
		return err
	}
	return writeFleetSection(res, "bench/results/"+t0.UTC().Format("2006-01-02")+"-fleet.json", mdPath)
}

// phases runs idle, memory and busy, then stops the processes.
func (f *simFleet) phases(ctx context.Context, res *fleetResult) error {
	f.sleep(ctx, seconds(f.cfg.SettleS))
	var err error
	f.logf("fleet: idle for %.0f s", f.cfg.IdleS)
	if res.Idle, err = f.idle(ctx); err != nil {
		return err
	}
	f.logf("fleet: idle: %.3f Redis calls per worker per second (server count)", res.Idle.PerWorkerPerS)
	if res.Memory, err = f.memory(ctx, res.Ledger); err != nil {
		return err
	}
	f.logf("fleet: memory: %.0f B per booked park, %.0f B per park in line", res.Memory.BookedBytes, res.Memory.LineBytes)
	for _, rule := range fleetCases {
		b, err := f.busy(ctx, rule)
		if err != nil {
			return err
		}
		res.Busy = append(res.Busy, b)
		f.logf("fleet: busy, %s: %.3f limiter calls, %.3f looks, %.3f writes per parked task; lost %d, doubled %d; lateness p99 %.1f ms",
			rule, b.PerParked, b.LooksPer, b.WritesPer, b.Lost, b.Doubled, b.LateP99Ms)
	}
	f.logf("fleet: idle again, after the busy phases, for %.0f s", f.cfg.IdleS)
	if res.IdleAfter, err = f.idle(ctx); err != nil {
		return err
	}
	f.logf("fleet: idle after: %.3f Redis calls per worker per second (server count)", res.IdleAfter.PerWorkerPerS)
	return f.stopProcs()
}

// stopProcs tells every process to stop, and waits for it.
func (f *simFleet) stopProcs() error {
	for i, p := range f.procs {
		var out simProgress
		if err := p.ask("stop", &out); err != nil {
			return fmt.Errorf("bench: fleet: stopping process %d: %w", i, err)
		}
		_ = p.in.Close()
		_ = p.cmd.Wait()
	}
	return nil
}

// startProcs starts the fleet processes and waits until each is ready.
func (f *simFleet) startProcs(ctx context.Context) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	per := (f.cfg.Workers + f.cfg.Procs - 1) / f.cfg.Procs
	for i := range f.cfg.Procs {
		spec := fleetChildSpec{Index: i, Procs: f.cfg.Procs, Addrs: f.cluster.Addrs, Workers: min(per, f.cfg.Workers-i*per),
			Concurrency: f.cfg.Concurrency, Shards: f.cfg.Shards, Prefix: "fleet:", fleetLoad: f.cfg.fleetLoad}
		b, _ := json.Marshal(spec)
		cmd := exec.CommandContext(ctx, exe, "-fleet-child", string(b))
		cmd.Stderr = os.Stderr
		dieWithParent(cmd)
		in, err := cmd.StdinPipe()
		if err != nil {
			return err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("bench: fleet: start process %d: %w", i, err)
		}
		f.procs = append(f.procs, &fleetProc{cmd: cmd, in: in, dec: json.NewDecoder(out)})
	}
	for i, p := range f.procs {
		var ready struct {
			Ready    bool  `json:"ready"`
			OffsetUs int64 `json:"offset_us"`
		}
		if err := p.dec.Decode(&ready); err != nil || !ready.Ready {
			return fmt.Errorf("bench: fleet: process %d did not start: %v", i, err)
		}
	}
	f.logf("fleet: %d workers ready in %d processes", f.cfg.Workers, f.cfg.Procs)
	return nil
}

// kill ends the processes that are still running.
func (f *simFleet) kill() {
	for _, p := range f.procs {
		_ = p.in.Close()
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			_ = p.cmd.Wait()
		}
	}
}

// askAll sends cmd to every process and returns their answers.
func (f *simFleet) askAll(cmd string) ([]simProgress, error) {
	out := make([]simProgress, len(f.procs))
	for i, p := range f.procs {
		if err := p.ask(cmd, &out[i]); err != nil {
			return nil, fmt.Errorf("bench: fleet: process %d, %s: %w", i, cmd, err)
		}
	}
	return out, nil
}

// stats reads INFO on every master.
func (f *simFleet) stats(ctx context.Context) (map[string]serverStats, error) {
	out := map[string]serverStats{}
	for a, rdb := range f.nodes {
		s, err := readStats(ctx, rdb)
		if err != nil {
			return nil, fmt.Errorf("bench: fleet: INFO on %s: %w", a, err)
		}
		out[a] = s
	}
	return out, nil
}

// waitFor asks every process for its progress until done says so, at most
// limit.
func (f *simFleet) waitFor(ctx context.Context, limit time.Duration, done func(sum simProgress) bool) (simProgress, error) {
	for end := time.Now().Add(limit); ; {
		ps, err := f.askAll("snap")
		if err != nil {
			return simProgress{}, err
		}
		sum := sumProgress(ps)
		if sum.Errors > 0 {
			f.logf("fleet: %d admission errors so far, the first: %s", sum.Errors, sum.FirstError)
		}
		if done(sum) {
			return sum, nil
		}
		if time.Now().After(end) || ctx.Err() != nil {
			return sum, fmt.Errorf("bench: fleet: not done within %v (%d busy starts, %d busy parks, %d memory starts, %d memory parks)", limit, sum.BusyRuns, sum.BusyParks, sum.HoldRuns, sum.HoldParks)
		}
		f.sleep(ctx, 500*time.Millisecond)
	}
}

func (f *simFleet) sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// ledgerNodes returns, per ledger shard, its key and the master holding it.
func (f *simFleet) ledgerNodes(ctx context.Context) ([]fleetShard, error) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: f.cluster.Addrs})
	defer rdb.Close()
	ledger, err := admission.NewShardedWakeups(rdb, admission.WakeupsKey, f.cfg.Shards)
	if err != nil {
		return nil, err
	}
	var out []fleetShard
	for _, k := range ledger.Keys() {
		n, err := nodeOf(ctx, rdb, k)
		if err != nil {
			return nil, err
		}
		out = append(out, fleetShard{Key: k, Node: n})
	}
	return out, nil
}

// ledgerBytes returns MEMORY USAGE of each ledger shard (0 if absent).
func (f *simFleet) ledgerBytes(ctx context.Context, shards []fleetShard) []int64 {
	out := make([]int64, len(shards))
	for i, s := range shards {
		out[i], _ = f.nodes[s.Node].MemoryUsage(ctx, s.Key, 0).Result()
	}
	return out
}

// sumProgress adds the processes' progress up.
func sumProgress(ps []simProgress) simProgress {
	var s simProgress
	for _, p := range ps {
		s.BusyRuns += p.BusyRuns
		s.BusyParks += p.BusyParks
		s.HoldRuns += p.HoldRuns
		s.HoldParks += p.HoldParks
		s.ParkedNow += p.ParkedNow
		s.Fallbacks += p.Fallbacks
		s.Errors += p.Errors
		s.LookErrors += p.LookErrors
		s.CPUNs += p.CPUNs
		if s.FirstError == "" {
			s.FirstError = p.FirstError
		}
		s.Counts = addCounts(s.Counts, p.Counts)
	}
	return s
}

// addCounts returns a + b; the per-worker counts are concatenated.
func addCounts(a, b simCountSnap) simCountSnap {
	out := simCountSnap{Limiter: map[string]int64{}, Other: map[string]int64{}, PerW: slices.Concat(a.PerW, b.PerW)}
	for _, m := range []map[string]int64{a.Limiter, b.Limiter} {
		for k, v := range m {
			out.Limiter[k] += v
		}
	}
	for _, m := range []map[string]int64{a.Other, b.Other} {
		for k, v := range m {
			out.Other[k] += v
		}
	}
	add := func(x, y []int64) []int64 {
		r := make([]int64, max(len(x), len(y)))
		for i := range r {
			if i < len(x) {
				r[i] += x[i]
			}
			if i < len(y) {
				r[i] += y[i]
			}
		}
		return r
	}
	out.Looks, out.Empty, out.Writes = add(a.Looks, b.Looks), add(a.Empty, b.Empty), add(a.Writes, b.Writes)
	return out
}

// subCounts returns b - a, for counts of the same processes.
func subCounts(b, a simCountSnap) simCountSnap {
	neg := func(v []int64) []int64 {
		r := make([]int64, len(v))
		for i, x := range v {
			r[i] = -x
		}
		return r
	}
	na := simCountSnap{Limiter: map[string]int64{}, Other: map[string]int64{}, Looks: neg(a.Looks), Empty: neg(a.Empty), Writes: neg(a.Writes)}
	for k, v := range a.Limiter {
		na.Limiter[k] = -v
	}
	for k, v := range a.Other {
		na.Other[k] = -v
	}
	out := addCounts(b, na)
	out.PerW = make([]int64, len(b.PerW))
	for i := range b.PerW {
		out.PerW[i] = b.PerW[i] - a.PerW[i]
	}
	return out
}

// fleetCommand is the fleet part's flags: which of its commands runs, and
// its sizes.
type fleetCommand struct {
	fleet  *bool
	report *string
	child  *string
	cfg    fleetConfig
}

// fleetFlags declares the fleet part's flags, its sizes over the defaults.
func fleetFlags() *fleetCommand {
	f := &fleetCommand{cfg: defaultFleetConfig()}
	f.fleet = flag.Bool("fleet", false, "run the fleet part (issue 25, about 5 minutes): simulated workers' ledger loops and admissions on a 3-master Redis Cluster it starts, idle, memory and busy; results/<date>-fleet.json and its BENCHMARKS.md section")
	f.report = flag.String("fleet-report", "", "rewrite only the fleet section of the report from this results file (results/<date>-fleet.json), run nothing")
	f.child = flag.String("fleet-child", "", "internal: run one fleet process from this JSON spec")
	cfg := &f.cfg
	flag.IntVar(&cfg.Workers, "fleet-workers", cfg.Workers, "with -fleet: simulated worker processes")
	flag.IntVar(&cfg.Procs, "fleet-procs", cfg.Procs, "with -fleet: OS processes the workers run in")
	flag.IntVar(&cfg.Concurrency, "fleet-concurrency", cfg.Concurrency, "with -fleet: task slots per worker")
	flag.IntVar(&cfg.Shards, "fleet-shards", cfg.Shards, "with -fleet: wake-up ledger shards")
	flag.IntVar(&cfg.Tenants, "fleet-tenants", cfg.Tenants, "with -fleet: tenants (subjects) of the booked case")
	flag.IntVar(&cfg.PerTenant, "fleet-per-tenant", cfg.PerTenant, "with -fleet: tasks per tenant, enqueued together")
	flag.IntVar(&cfg.LinedTenants, "fleet-lined-tenants", cfg.LinedTenants, "with -fleet: tenants of the lined case (default horizon), arriving at the same rate")
	flag.IntVar(&cfg.MemTenants, "fleet-mem-tenants", cfg.MemTenants, "with -fleet: tenants of the memory phase")
	flag.DurationVar(&cfg.Interval, "fleet-interval", cfg.Interval, "with -fleet: the busy rules let one task per tenant per this")
	flag.DurationVar(&cfg.Horizon, "fleet-horizon", cfg.Horizon, "with -fleet: the lined case's horizon (0: admission's default)")
	flag.DurationVar(&cfg.Arrival, "fleet-arrival", cfg.Arrival, "with -fleet: the booked case's tenants arrive evenly over this")
	flag.Float64Var(&cfg.IdleS, "fleet-idle", cfg.IdleS, "with -fleet: seconds of each idle phase")
	return f
}

// chosen reports whether one of the fleet part's commands was asked for.
func (f *fleetCommand) chosen() bool { return *f.fleet || *f.report != "" || *f.child != "" }

// run runs the command asked for, with the report at mdPath, and returns
// the exit code.
func (f *fleetCommand) run(mdPath string) int {
	var err error
	switch {
	case *f.child != "":
		err = fleetChildMain(*f.child, os.Stdin, os.Stdout)
	case *f.report != "":
		err = rewriteFleetSection(*f.report, mdPath)
	default:
		err = runFleetPart(func(format string, args ...any) {
			fmt.Fprintf(os.Stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
		}, f.cfg, mdPath)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}
