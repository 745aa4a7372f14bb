package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// fleetResult is the part's results file.
type fleetResult struct {
	partHead
	Config   fleetConfig  `json:"config"`
	RuntimeS float64      `json:"runtime_s"`
	Ledger   []fleetShard `json:"ledger"`
	Idle     *fleetIdle   `json:"idle"`
	// IdleAfter is the same fleet idle again after the busy phases: what
	// the backlog left behind in the ledger.
	IdleAfter *fleetIdle   `json:"idle_after"`
	Memory    *fleetMemory `json:"memory"`
	Busy      []*fleetBusy `json:"busy"` // one per case (fleetCases)
	Targets   []target     `json:"targets"`
}

// fleetShard is a ledger shard's key and the master that holds it.
type fleetShard struct {
	Key  string `json:"key"`
	Node string `json:"node"`
}

// fleetNode is what one master did in a phase: its commands as clients
// sent them (clientCommand: scripts' own calls left out), by name, its
// scripts' PUBLISHes and SPUBLISHes, CPU, connections.
type fleetNode struct {
	Calls     int64            `json:"calls"`
	ByCommand map[string]int64 `json:"by_command"`
	Publishes int64            `json:"publishes"` // PUBLISH and SPUBLISH
	CPUS      float64          `json:"cpu_s"`
	Clients   int64            `json:"clients"`
	Memory    int64            `json:"used_memory"`
}

// clientCommand reports whether calls of the command (INFO commandstats
// name) are all sent by clients: scripts cannot call these, so their count
// is the clients' (Redis counts a script's own calls with the others).
// INFO is the bench's own.
func clientCommand(name string) bool {
	base, _, _ := strings.Cut(name, "|")
	switch base {
	case "evalsha", "eval", "evalsha_ro", "eval_ro", "ping", "subscribe", "unsubscribe", "psubscribe", "punsubscribe",
		"ssubscribe", "cluster", "hello", "client", "readonly", "command", "select", "auth", "script", "quit":
		return true
	}
	return false
}

// nodeDelta is what each master did between two INFO readings.
func nodeDelta(a, b map[string]serverStats) map[string]fleetNode {
	out := map[string]fleetNode{}
	for addr, sb := range b {
		sa := a[addr]
		n := fleetNode{ByCommand: map[string]int64{}, CPUS: sb.CPU - sa.CPU, Clients: sb.Clients, Memory: sb.Memory,
			Publishes: sb.Calls["publish"] - sa.Calls["publish"] + sb.Calls["spublish"] - sa.Calls["spublish"]}
		for name, c := range sb.Calls {
			if d := c - sa.Calls[name]; d > 0 && clientCommand(name) {
				n.ByCommand[name] = d
				n.Calls += d
			}
		}
		out[addr] = n
	}
	return out
}

func totalCalls(nodes map[string]fleetNode) (n int64) {
	for _, x := range nodes {
		n += x.Calls
	}
	return n
}

// stuck returns up to 20 ledger members per shard due more than a second
// ago, with how overdue: wake-ups no loop took.
func (f *simFleet) stuck(ctx context.Context) []string {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: f.cluster.Addrs})
	defer rdb.Close()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, sh := range f.ledger {
		zs, err := rdb.ZRangeByScoreWithScores(ctx, sh.Key, &redis.ZRangeBy{Min: "-inf", Max: fmt.Sprint(now.Add(-time.Second).UnixMicro()), Count: 20}).Result()
		if err != nil {
			out = append(out, err.Error())
		}
		for _, z := range zs {
			out = append(out, fmt.Sprintf("%s: %v overdue in %s", z.Member, now.Sub(time.UnixMicro(int64(z.Score))).Round(time.Millisecond), sh.Key))
		}
	}
	return out
}

// snapshot reads INFO on every master, then every process's counts.
func (f *simFleet) snapshot(ctx context.Context) (map[string]serverStats, simProgress, error) {
	s, err := f.stats(ctx)
	if err != nil {
		return nil, simProgress{}, err
	}
	ps, err := f.askAll("snap")
	return s, sumProgress(ps), err
}

// fleetIdle is the idle phase: no task anywhere.
type fleetIdle struct {
	DurationS     float64              `json:"duration_s"`
	Nodes         map[string]fleetNode `json:"nodes"`
	Calls         int64                `json:"calls"` // clients' commands on every master
	PerWorkerPerS float64              `json:"per_worker_per_s"`
	Client        simCountSnap         `json:"client"` // the workers' hooked commands
	// WorkerMin, WorkerMedian, WorkerMax: hooked commands per second of
	// the least, median and most active worker.
	WorkerMin, WorkerMedian, WorkerMax float64
	Load                               string `json:"load"`
}

func (f *simFleet) idle(ctx context.Context) (*fleetIdle, error) {
	s0, p0, err := f.snapshot(ctx)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	f.sleep(ctx, seconds(f.cfg.IdleS))
	s1, p1, err := f.snapshot(ctx)
	if err != nil {
		return nil, err
	}
	d := time.Since(start).Seconds()
	r := &fleetIdle{DurationS: d, Nodes: nodeDelta(s0, s1), Load: loadavg()}
	r.Calls = totalCalls(r.Nodes)
	r.PerWorkerPerS = float64(r.Calls) / float64(f.cfg.Workers) / d
	r.Client = subCounts(p1.Counts, p0.Counts)
	per := slices.Clone(r.Client.PerW)
	slices.Sort(per)
	if len(per) > 0 {
		r.WorkerMin, r.WorkerMedian, r.WorkerMax = float64(per[0])/d, float64(per[len(per)/2])/d, float64(per[len(per)-1])/d
	}
	r.Client.PerW = nil
	return r, nil
}

// fleetMemory is the memory phase: MemTenants tenants run one task of the
// hold rule each, then park one on a booked turn each, then one in line.
type fleetMemory struct {
	Tenants int `json:"tenants"`
	// UsedMemory[step][master]: used_memory after the runs, the booked
	// parks and the parks in line.
	UsedMemory  []map[string]int64 `json:"used_memory"`
	LedgerBytes [][]int64          `json:"ledger_bytes"` // MEMORY USAGE of each shard, per step
	// KeyBytes[step]: MEMORY USAGE summed over the limiter's keys and the
	// ledger's, every master: steadier than used_memory, which moves by
	// megabytes with the connections' buffers on a master holding
	// thousands of them.
	KeyBytes    []int64            `json:"key_bytes"`
	KeyBooked   float64            `json:"key_bytes_per_booked_park"`
	KeyLine     float64            `json:"key_bytes_per_park_in_line"`
	BookedBytes float64            `json:"booked_bytes_per_park"`
	LineBytes   float64            `json:"line_bytes_per_park"`
	LedgerPer   float64            `json:"ledger_bytes_per_booked_park"`
	BookedShare map[string]float64 `json:"booked_share_by_master"` // of the booked parks' bytes
}

func (f *simFleet) memory(ctx context.Context, shards []fleetShard) (*fleetMemory, error) {
	n := int64(f.cfg.MemTenants)
	m := &fleetMemory{Tenants: f.cfg.MemTenants}
	steps := []struct {
		cmd  string
		done func(simProgress) bool
	}{
		{"hold-run", func(s simProgress) bool { return s.HoldRuns >= n }},
		{"hold-park", func(s simProgress) bool { return s.HoldParks >= n }},
		{"hold-line", func(s simProgress) bool { return s.HoldParks >= 2*n }},
	}
	for _, st := range steps {
		f.logf("fleet: memory: %s for %d tenants", st.cmd, n)
		if _, err := f.askAll(st.cmd); err != nil {
			return nil, err
		}
		if _, err := f.waitFor(ctx, 3*time.Minute, st.done); err != nil {
			return nil, err
		}
		f.sleep(ctx, time.Second)
		s, err := f.stats(ctx)
		if err != nil {
			return nil, err
		}
		used := map[string]int64{}
		for a, x := range s {
			used[a] = x.Memory - x.ClientMemory // the connections' buffers move with traffic, not with tasks
		}
		m.UsedMemory = append(m.UsedMemory, used)
		m.LedgerBytes = append(m.LedgerBytes, f.ledgerBytes(ctx, shards))
		kb, err := f.keyBytes(ctx, "fleet:*") // the memory phase runs before any other task
		if err != nil {
			return nil, err
		}
		m.KeyBytes = append(m.KeyBytes, kb+sum64(m.LedgerBytes[len(m.LedgerBytes)-1]))
	}
	m.KeyBooked = float64(m.KeyBytes[1]-m.KeyBytes[0]) / float64(n)
	m.KeyLine = float64(m.KeyBytes[2]-m.KeyBytes[1]) / float64(n)
	sum := func(step int) (t int64) {
		for _, v := range m.UsedMemory[step] {
			t += v
		}
		return t
	}
	m.BookedBytes = float64(sum(1)-sum(0)) / float64(n)
	m.LineBytes = float64(sum(2)-sum(1)) / float64(n)
	var l0, l1 int64
	for i := range shards {
		l0, l1 = l0+m.LedgerBytes[0][i], l1+m.LedgerBytes[1][i]
	}
	m.LedgerPer = float64(l1-l0) / float64(n)
	m.BookedShare = map[string]float64{}
	for a := range m.UsedMemory[0] {
		m.BookedShare[a] = float64(m.UsedMemory[1][a]-m.UsedMemory[0][a]) / float64(sum(1)-sum(0))
	}
	return m, nil
}

// keyBytes sums MEMORY USAGE (every element counted) over the keys
// matching pattern on every master.
func (f *simFleet) keyBytes(ctx context.Context, pattern string) (int64, error) {
	var total int64
	for addr, rdb := range f.nodes {
		var cursor uint64
		for {
			keys, next, err := rdb.Scan(ctx, cursor, pattern, 1000).Result()
			if err != nil {
				return 0, fmt.Errorf("bench: fleet: SCAN on %s: %w", addr, err)
			}
			pipe := rdb.Pipeline()
			cmds := make([]*redis.IntCmd, len(keys))
			for i, k := range keys {
				cmds[i] = pipe.MemoryUsage(ctx, k, 0)
			}
			if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
				return 0, fmt.Errorf("bench: fleet: MEMORY USAGE on %s: %w", addr, err)
			}
			for _, c := range cmds {
				total += c.Val()
			}
			if cursor = next; cursor == 0 {
				return total, nil
			}
		}
	}
	return total, nil
}

// fleetBusy is one busy phase: a case.
type fleetBusy struct {
	Rule      string `json:"rule"`    // the case: linedRule or bookedRule
	Horizon   string `json:"horizon"` // its rule's Settings.Horizon
	Tenants   int    `json:"tenants"`
	Tasks     int    `json:"tasks"`
	TimedOut  bool   `json:"timed_out,omitempty"` // not every task started within a minute of its ideal drain
	PerTenant int    `json:"per_tenant"`
	// LostExamples describes up to 10 tasks that never started; Stuck
	// lists ledger members due more than a second ago that nobody took,
	// with how overdue (read when a case did not drain in time).
	LostExamples []string `json:"lost_examples,omitempty"`
	Stuck        []string `json:"stuck,omitempty"`
	DurationS    float64  `json:"duration_s"`   // from the first arrival to the last start
	IdealS       float64  `json:"ideal_s"`      // Arrival + (PerTenant-1) × Interval
	Runs         int64    `json:"runs"`         // starts, every process
	Lost         int      `json:"lost"`         // tasks never started
	Doubled      int      `json:"doubled"`      // tasks started more than once
	Parks        int64    `json:"parks"`        // park decisions
	ParkedTasks  int64    `json:"parked_tasks"` // tasks parked at least once
	Straight     int64    `json:"straight"`     // tasks never parked: one limiter call each
	Redeemed     int64    `json:"redeemed"`     // starts on a turn booked before
	NewTurn      int64    `json:"new_turn"`     // parked tasks that started on a new turn: back later than the tolerance
	LateUnknown  int64    `json:"late_unknown"` // of those, parked in line: their booked slot is not known here
	Fallbacks    int64    `json:"fallbacks"`    // parks whose wake-up was not recorded
	Errors       int64    `json:"errors"`       // admission errors (retried a second later)
	FirstError   string   `json:"first_error,omitempty"`
	LimiterCall  int64    `json:"limiter_calls"`    // the busy rule's script calls
	PerTask      float64  `json:"limiter_per_task"` // over every task
	// PerParked is (limiter calls - Straight) / ParkedTasks: a task never
	// parked costs one call, the rest is the parked tasks'.
	PerParked float64 `json:"limiter_per_parked"`
	Looks     []int64 `json:"looks"` // by shard
	Empty     []int64 `json:"empty_looks"`
	Writes    []int64 `json:"writes"`
	LooksPer  float64 `json:"looks_per_parked"`
	EmptyPer  float64 `json:"empty_looks_per_parked"`
	WritesPer float64 `json:"writes_per_parked"`
	// Lateness: a parked task's start after its slot (the turn it
	// redeemed, or the one it was parked for if it took a new one).
	LateP50Ms   float64              `json:"late_p50_ms"`
	LateP99Ms   float64              `json:"late_p99_ms"`
	LateMaxMs   float64              `json:"late_max_ms"`
	EarlyMaxMs  float64              `json:"early_max_ms"` // the most a redeemed start came before its slot
	PeakParked  int64                `json:"peak_parked"`
	Nodes       map[string]fleetNode `json:"nodes"`
	Calls       int64                `json:"calls"`
	PerWorkerS  float64              `json:"per_worker_per_s"`
	CallsPerRun float64              `json:"calls_per_task"`
	ClientOther map[string]int64     `json:"client_other,omitempty"`
	ClientCPUS  float64              `json:"client_cpu_s"`
	LoadMin     float64              `json:"load_min"`
	LoadMax     float64              `json:"load_max"`
	LoadMean    float64              `json:"load_mean"`
}

func (f *simFleet) busy(ctx context.Context, rule string) (*fleetBusy, error) {
	c := f.cfg
	tenants, arrival := c.tenants(rule)
	b := &fleetBusy{Rule: rule, Horizon: "default (1s)", Tenants: tenants, PerTenant: c.PerTenant, Tasks: tenants * c.PerTenant, IdealS: (arrival + time.Duration(c.PerTenant-1)*c.Interval).Seconds()}
	switch {
	case rule == bookedRule:
		b.Horizon = (time.Duration(c.PerTenant+1) * c.Interval).String()
	case c.Horizon != 0:
		b.Horizon = c.Horizon.String()
	}
	s0, p0, err := f.snapshot(ctx)
	if err != nil {
		return nil, err
	}
	f.logf("fleet: busy, %s: %d tenants × %d tasks arriving over %v, one task per %v per tenant, horizon %s", rule, tenants, c.PerTenant, arrival, c.Interval, b.Horizon)
	start := time.Now()
	if _, err := f.askAll("busy " + rule); err != nil {
		return nil, err
	}
	var loads []float64
	last, lastAt := int64(-1), start
	_, err = f.waitFor(ctx, arrival+time.Duration(c.PerTenant)*c.Interval+time.Minute, func(s simProgress) bool {
		loads = append(loads, load1())
		b.PeakParked = max(b.PeakParked, s.ParkedNow)
		if runs := s.BusyRuns - p0.BusyRuns; runs != last {
			last, lastAt = runs, time.Now()
			if len(loads)%20 == 0 {
				f.logf("fleet: busy, %s: %d of %d started, %d parked now, load %.1f", rule, runs, b.Tasks, s.ParkedNow, loads[len(loads)-1])
			}
		}
		return last >= int64(b.Tasks)
	})
	if err != nil && ctx.Err() == nil {
		// Not every task started in time: measure what did.
		f.logf("fleet: busy, %s: %v; measuring what started", rule, err)
		b.TimedOut = true
		b.Stuck = f.stuck(ctx)
	} else if err != nil {
		return nil, err
	}
	b.DurationS = lastAt.Sub(start).Seconds()
	f.sleep(ctx, 3*time.Second) // a doubled wake-up would start its task again by now
	s1, err := f.stats(ctx)
	if err != nil {
		return nil, err
	}
	b.Nodes = nodeDelta(s0, s1)
	b.LoadMin, b.LoadMax, b.LoadMean = minMaxMean(loads)
	return b, f.finishBusy(ctx, b, p0)
}

// finishBusy fills in b from the processes' counts since p0 and their runs.
func (f *simFleet) finishBusy(ctx context.Context, b *fleetBusy, p0 simProgress) error {
	var runs []simRun
	for i, p := range f.procs {
		var out struct {
			Runs []simRun `json:"runs"`
		}
		if err := p.ask("runs", &out); err != nil {
			return fmt.Errorf("bench: fleet: runs of process %d: %w", i, err)
		}
		runs = append(runs, out.Runs...)
	}
	ps, err := f.askAll("snap")
	if err != nil {
		return err
	}
	p1 := sumProgress(ps)
	d := subCounts(p1.Counts, p0.Counts)
	b.Parks, b.Fallbacks, b.Errors, b.FirstError = p1.BusyParks-p0.BusyParks, p1.Fallbacks-p0.Fallbacks, p1.Errors-p0.Errors, p1.FirstError
	b.ClientCPUS = float64(p1.CPUNs-p0.CPUNs) / 1e9
	b.LimiterCall = d.Limiter[b.Rule]
	b.Looks, b.Empty, b.Writes, b.ClientOther = d.Looks, d.Empty, d.Writes, d.Other
	b.tally(runs)
	b.PerTask = float64(b.LimiterCall) / float64(b.Tasks)
	parked := float64(max(b.ParkedTasks, 1))
	b.PerParked = float64(b.LimiterCall-b.Straight) / parked
	b.LooksPer, b.EmptyPer, b.WritesPer = float64(sum64(b.Looks))/parked, float64(sum64(b.Empty))/parked, float64(sum64(b.Writes))/parked
	b.Calls = totalCalls(b.Nodes)
	b.PerWorkerS = float64(b.Calls) / float64(f.cfg.Workers) / max(b.DurationS, 1)
	b.CallsPerRun = float64(b.Calls) / float64(b.Tasks)
	return nil
}

// tally counts starts per task (lost, doubled), the parked tasks, and
// how late each parked task started after the slot it was parked for (or,
// on a redeemed turn, the turn it started on).
func (b *fleetBusy) tally(recs []simRun) {
	recs = slices.DeleteFunc(recs, func(r simRun) bool { return r.Rule != b.Rule || r.Task < 0 || r.Task >= b.Tasks })
	slices.SortFunc(recs, func(x, y simRun) int { return cmp.Or(cmp.Compare(x.Task, y.Task), cmp.Compare(x.AtUs, y.AtUs)) })
	starts := make([]uint8, b.Tasks)
	parked := make([]bool, b.Tasks)
	var late []int64
	var last simRun // the task's latest park
	b.lostExamples(recs)
	for _, r := range recs {
		if r.Park {
			parked[r.Task], last = true, r
			continue
		}
		starts[r.Task] = min(starts[r.Task]+1, 255)
		b.Runs++
		switch {
		case starts[r.Task] > 1: // doubled: counted below, timed once
		case r.Redeemed:
			b.Redeemed++
			late = append(late, r.AtUs-r.SlotUs)
		case !parked[r.Task]:
		case last.Task == r.Task && !last.InLine:
			b.NewTurn++
			late = append(late, r.AtUs-last.SlotUs)
		default:
			b.NewTurn++
			b.LateUnknown++
		}
	}
	for i, n := range starts {
		switch {
		case n == 0:
			b.Lost++
		case n > 1:
			b.Doubled++
		}
		if parked[i] {
			b.ParkedTasks++
		}
	}
	b.Straight = int64(b.Tasks) - b.ParkedTasks
	slices.Sort(late)
	if len(late) > 0 {
		q := func(p float64) float64 { return float64(late[int(p*float64(len(late)-1))]) / 1000 }
		b.LateP50Ms, b.LateP99Ms, b.LateMaxMs = q(0.5), q(0.99), q(1)
		b.EarlyMaxMs = math.Max(0, -float64(late[0])/1000)
	}
}

// lostExamples records, for up to 10 tasks that never started, what was
// recorded of them: their parks, on the Redis clock.
func (b *fleetBusy) lostExamples(recs []simRun) {
	started := map[int]bool{}
	for _, r := range recs {
		if !r.Park {
			started[r.Task] = true
		}
	}
	byTask := map[int][]string{}
	for _, r := range recs {
		if !started[r.Task] && len(byTask) <= 10 {
			byTask[r.Task] = append(byTask[r.Task], fmt.Sprintf("parked at %d µs for %d µs (in line %v)", r.AtUs, r.SlotUs, r.InLine))
		}
	}
	for task, parks := range byTask {
		b.LostExamples = append(b.LostExamples, fmt.Sprintf("task %d (tenant %d): %s", task, task/max(b.PerTenant, 1), strings.Join(parks, "; ")))
	}
	slices.Sort(b.LostExamples)
}

func sum64(v []int64) (t int64) {
	for _, x := range v {
		t += x
	}
	return t
}

func minMaxMean(v []float64) (lo, hi, mean float64) {
	if len(v) == 0 {
		return 0, 0, 0
	}
	lo, hi = v[0], v[0]
	for _, x := range v {
		lo, hi, mean = math.Min(lo, x), math.Max(hi, x), mean+x
	}
	return lo, hi, mean / float64(len(v))
}

// readFleet reads the newest results/*-fleet.json, if any.
func readFleet() (*fleetResult, string) {
	var r fleetResult
	path := readNewest("*-fleet.json", &r)
	if path == "" || len(r.Busy) == 0 {
		return nil, ""
	}
	return &r, path
}
