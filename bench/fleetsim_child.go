package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// One fleet process (go run . -fleet-child SPEC, started by the fleet part):
// a share of the simulated workers, each what a cmd/worker process does
// for admission, without asynq: its own Redis Cluster client, its own
// limiter and admission gates over it, and its own parking with a wake-up
// loop (admission.Parking.Run) on the shared sharded ledger. asynq's queue
// is stood in for by one queue in memory per process: a task is named by
// its ID alone, so a wake-up taken by any process brings the task back to
// that process's queue, and the worker slots of that process run it.

// fleetChildSpec is what one fleet process runs.
type fleetChildSpec struct {
	Index       int      `json:"index"`
	Procs       int      `json:"procs"`
	Addrs       []string `json:"addrs"`
	Workers     int      `json:"workers"`     // simulated workers in this process
	Concurrency int      `json:"concurrency"` // task slots per worker
	Shards      int      `json:"shards"`
	Prefix      string   `json:"prefix"`
	fleetLoad
}

// fleetLoad is the tasks of the fleet part, the same in every process.
type fleetLoad struct {
	Tenants    int           `json:"tenants"`
	PerTenant  int           `json:"per_tenant"` // busy tasks per tenant, enqueued together
	Interval   time.Duration `json:"interval"`   // the busy rule: one task per Interval per tenant
	Horizon    time.Duration `json:"horizon"`    // the lined case's Settings.Horizon (0: default)
	Arrival    time.Duration `json:"arrival"`    // the tenants arrive evenly over this
	MemTenants int           `json:"mem_tenants"`
	// LinedTenants is the lined case's tenants, arriving at the same rate
	// as the booked case's (Tenants over Arrival).
	LinedTenants int `json:"lined_tenants"`
}

// tenants returns how many tenants the busy case of rule has, and over
// how long they arrive.
func (l fleetLoad) tenants(rule string) (int, time.Duration) {
	if rule == linedRule {
		return l.LinedTenants, time.Duration(float64(l.Arrival) * float64(l.LinedTenants) / float64(l.Tenants))
	}
	return l.Tenants, l.Arrival
}

// The rules of the fleet part, one per busy case and the memory step's.
// linedRule has the Horizon given (the default: a turn more than a second
// ahead waits in the tenant's line); bookedRule's Horizon covers a tenant's
// tasks, so that each parked task books its turn at once. holdRule parks
// its second task of a tenant on a turn booked holdInterval ahead (within
// holdHorizon), its third in the tenant's line: the memory step's tasks,
// which never come due during the run. Rule names are also the tasks' ID
// letters and the keys' ends, so none starts with another.
const (
	linedRule    = "lined"
	bookedRule   = "booked"
	holdRule     = "hold"
	fleetQueue   = "fleet"
	holdInterval = 40 * time.Minute
	holdHorizon  = time.Hour
)

// fleetCases are the busy cases, by rule, in the order they run: the
// lined case last, as its tenants' lines keep being served after they
// empty (see BENCHMARKS.md).
var fleetCases = []string{bookedRule, linedRule}

// simTask is one task: rule's task k of tenant. Its ID is the rule's first
// letter, the tenant and k.
type simTask struct {
	rule      string
	tenant, k int
}

func (t simTask) id() string { return fmt.Sprintf("%c%d.%d", t.rule[0], t.tenant, t.k) }

func (t simTask) hold() bool { return t.rule == holdRule }

func parseSimTask(id string) (simTask, bool) {
	if len(id) < 2 {
		return simTask{}, false
	}
	rule := ""
	for _, r := range []string{linedRule, bookedRule, holdRule} {
		if r[0] == id[0] {
			rule = r
		}
	}
	a, b, ok := strings.Cut(id[1:], ".")
	tenant, err1 := strconv.Atoi(a)
	k, err2 := strconv.Atoi(b)
	return simTask{rule: rule, tenant: tenant, k: k}, rule != "" && ok && err1 == nil && err2 == nil
}

// simWorker is one simulated worker process.
type simWorker struct {
	rdb     *redis.ClusterClient
	lims    []*throttle.Limiter
	gates   map[string]*admission.Gate
	parking *admission.Parking
	shared  *admission.Slots
}

// simRun is one busy task's start or park (Park): its case (rule), its
// index, when (µs of the Redis clock) and its turn's slot (µs of the Redis
// clock; for a park in line, the fallback only). Redeemed: the start was on
// a turn booked before.
type simRun struct {
	Rule     string `json:"c"`
	Task     int    `json:"t"`
	Park     bool   `json:"p,omitempty"`
	InLine   bool   `json:"i,omitempty"`
	Redeemed bool   `json:"r,omitempty"`
	AtUs     int64  `json:"a"`
	SlotUs   int64  `json:"s"`
}

// simProgress is what a fleet process reports on "snap".
type simProgress struct {
	Counts     simCountSnap `json:"counts"`
	BusyRuns   int64        `json:"busy_runs"`
	BusyParks  int64        `json:"busy_parks"`
	HoldRuns   int64        `json:"hold_runs"`
	HoldParks  int64        `json:"hold_parks"`
	ParkedNow  int64        `json:"parked_now"`
	Fallbacks  int64        `json:"fallbacks"` // parks whose wake-up could not be recorded
	Errors     int64        `json:"errors"`
	FirstError string       `json:"first_error,omitempty"`
	LookErrors int64        `json:"look_errors"`
	CPUNs      int64        `json:"cpu_ns"`
}

type simChild struct {
	spec    fleetChildSpec
	counts  *simCounts
	workers []*simWorker
	queue   chan simTask
	offset  time.Duration // Redis clock minus this process's clock

	busyRuns, busyParks, holdRuns, holdParks, parkedNow, fallbacks, errs, lookErrs atomic.Int64

	firstErr atomic.Pointer[string]
	mu       sync.Mutex
	runs     []simRun
}

// fleetChildMain runs one fleet process: it starts its workers, says
// "ready", then obeys the commands its parent writes on stdin, one a line
// (snap, hold-run, hold-park, hold-line, busy RULE, runs, stop), answering
// each with one line of JSON on out.
func fleetChildMain(specJSON string, in io.Reader, out io.Writer) error {
	var spec fleetChildSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		return fmt.Errorf("bench: fleet child spec: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &simChild{spec: spec, queue: make(chan simTask, 1<<20)}
	if err := c.start(ctx); err != nil {
		return err
	}
	enc := json.NewEncoder(out)
	if err := enc.Encode(map[string]any{"ready": true, "offset_us": c.offset.Microseconds()}); err != nil {
		return err
	}
	sc := bufio.NewScanner(in)
	var loops sync.WaitGroup
	for sc.Scan() {
		cmd := strings.TrimSpace(sc.Text())
		switch cmd {
		case "snap":
		case "hold-run", "hold-park", "hold-line":
			k := map[string]int{"hold-run": 0, "hold-park": 1, "hold-line": 2}[cmd]
			for i := spec.Index; i < spec.MemTenants; i += spec.Procs {
				c.queue <- simTask{rule: holdRule, tenant: i, k: k}
			}
		case "busy " + linedRule, "busy " + bookedRule:
			loops.Add(1)
			go func() { defer loops.Done(); c.feed(ctx, strings.TrimPrefix(cmd, "busy ")) }()
		case "runs":
			c.mu.Lock()
			err := enc.Encode(map[string]any{"runs": c.runs})
			c.runs = nil
			c.mu.Unlock()
			if err != nil {
				return err
			}
			continue
		case "stop":
			cancel()
			loops.Wait()
			c.stop()
			c.mu.Lock()
			defer c.mu.Unlock()
			return enc.Encode(c.progress())
		default:
			return fmt.Errorf("bench: fleet child: unknown command %q", cmd)
		}
		if err := enc.Encode(c.progress()); err != nil {
			return err
		}
	}
	return errors.New("bench: fleet child: stdin closed before stop")
}

// start builds the process's workers and starts their wake-up loops and
// task slots.
func (c *simChild) start(ctx context.Context) error {
	s := c.spec
	probe := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.Addrs})
	defer probe.Close()
	ledger, err := admission.NewShardedWakeups(probe, admission.WakeupsKey, s.Shards)
	if err != nil {
		return err
	}
	if err := probe.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("bench: fleet: %w", err)
	}
	c.offset = time.Duration(redisOffset(ctx, probe) * 1e3)
	c.counts = newSimCounts(ledger.Keys(), []string{linedRule, bookedRule, holdRule}, s.Workers)
	for w := range s.Workers {
		sw, err := c.newWorker(w)
		if err != nil {
			return err
		}
		c.workers = append(c.workers, sw)
		go func() {
			_ = sw.parking.Run(ctx, admission.RunOptions{OnError: func(error) { c.lookErrs.Add(1) }}, c.wake)
		}()
		for range s.Concurrency {
			go c.slot(ctx, sw)
		}
	}
	return nil
}

// newWorker returns simulated worker w: its own cluster client (hooked),
// limiter, gates and parking.
func (c *simChild) newWorker(w int) (*simWorker, error) {
	s := c.spec
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.Addrs, PoolSize: 4})
	rdb.AddHook(c.counts.hook(w))
	sw := &simWorker{rdb: rdb, gates: map[string]*admission.Gate{}, shared: admission.NewSlots(max(s.Concurrency/2, 1))}
	ledger, err := admission.NewShardedWakeups(rdb, admission.WakeupsKey, s.Shards)
	if err != nil {
		return nil, err
	}
	if sw.parking, err = admission.NewParking(ledger, admission.ParkingOptions{Logger: slog.New(slog.DiscardHandler)}); err != nil {
		return nil, err
	}
	rules := []struct {
		name     string
		interval time.Duration
		horizon  time.Duration
	}{{linedRule, s.Interval, s.Horizon}, {bookedRule, s.Interval, time.Duration(s.PerTenant+1) * s.Interval}, {holdRule, holdInterval, holdHorizon}}
	for _, r := range rules {
		lim, err := throttle.New(rdb, throttle.Options{Prefix: s.Prefix}, throttle.Rule{Name: r.name, Algorithm: throttle.GCRA,
			Limit: throttle.Limit{Count: 1, Period: r.interval, Burst: 1}})
		if err != nil {
			return nil, err
		}
		g, err := admission.New(lim, admission.Options{Settings: admission.Settings{Horizon: r.horizon}, Shared: sw.shared, Parking: sw.parking, Name: r.name})
		if err != nil {
			return nil, err
		}
		sw.lims = append(sw.lims, lim)
		sw.gates[r.name] = g
	}
	sw.parking.Serve(sw.gates)
	return sw, nil
}

// wake is the wake function of every worker of the process: the task the
// ledger names goes back to this process's queue.
func (c *simChild) wake(_ context.Context, job admission.JobEntry) error {
	t, ok := parseSimTask(job.ID)
	if !ok {
		return fmt.Errorf("bench: fleet: woken %q is no task of the bench", job.ID)
	}
	c.queue <- t
	return nil
}

// slot is one task slot of worker sw: it takes tasks from the queue and
// admits each through the worker's gate.
func (c *simChild) slot(ctx context.Context, sw *simWorker) {
	for {
		select {
		case <-ctx.Done():
			return
		case t := <-c.queue:
			c.admit(ctx, sw, t)
		}
	}
}

// admit runs, parks or retries t, as the worker middleware would.
func (c *simChild) admit(ctx context.Context, sw *simWorker, t simTask) {
	member := admission.JobEntry{Queue: fleetQueue, ID: t.id()}.Member()
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	d, err := sw.gates[t.rule].Admit(actx, admission.Request{Subject: fmt.Sprintf("tenant-%d", t.tenant),
		Caller: throttle.Caller{ID: t.id(), BookAs: t.id(), Waiter: member, WaitAs: member}})
	switch {
	case ctx.Err() != nil:
		return
	case err != nil:
		c.fail(err)
		time.AfterFunc(time.Second, func() { c.requeue(ctx, t) }) // asynq's retry
	case d.Outcome == admission.Park:
		c.parked(ctx, t, d)
	default:
		c.ran(t, d)
	}
}

func (c *simChild) requeue(ctx context.Context, t simTask) {
	if ctx.Err() == nil {
		c.queue <- t
	}
}

func (c *simChild) fail(err error) {
	if c.errs.Add(1) == 1 {
		msg := err.Error()
		c.firstErr.Store(&msg)
	}
}

// parked counts a park; a task whose wake-up could not be recorded comes
// back at its turn by itself, as asynq's retry would bring it.
func (c *simChild) parked(ctx context.Context, t simTask, d admission.Decision) {
	if t.hold() {
		c.holdParks.Add(1)
		return
	}
	c.busyParks.Add(1)
	c.parkedNow.Add(1)
	c.record(simRun{Rule: t.rule, Task: c.index(t), Park: true, InLine: d.InLine, AtUs: time.Now().Add(c.offset).UnixMicro(), SlotUs: d.Slot.UnixMicro()})
	if !d.Woken {
		c.fallbacks.Add(1)
		time.AfterFunc(time.Until(d.At), func() { c.requeue(ctx, t) })
	}
}

// ran records a run: for a task on a booked turn, how late it started.
func (c *simChild) ran(t simTask, d admission.Decision) {
	if t.hold() {
		c.holdRuns.Add(1)
		return
	}
	c.busyRuns.Add(1)
	r := simRun{Rule: t.rule, Task: c.index(t), Redeemed: d.Status == throttle.Redeemed, AtUs: d.At.Add(c.offset).UnixMicro(), SlotUs: d.Slot.UnixMicro()}
	if r.Redeemed {
		c.parkedNow.Add(-1)
	}
	c.record(r)
}

func (c *simChild) record(r simRun) {
	c.mu.Lock()
	c.runs = append(c.runs, r)
	c.mu.Unlock()
}

func (c *simChild) index(t simTask) int { return t.tenant*c.spec.PerTenant + t.k }

// feed enqueues this process's share of the busy tasks of rule: tenant i,
// with all its tasks, at i/Tenants of Arrival after the start.
func (c *simChild) feed(ctx context.Context, rule string) {
	s := c.spec
	tenants, arrival := s.tenants(rule)
	start := time.Now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	next := s.Index
	for next < tenants {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for ; next < tenants && time.Duration(float64(arrival)*float64(next)/float64(tenants)) <= time.Since(start); next += s.Procs {
			for k := range s.PerTenant {
				c.queue <- simTask{rule: rule, tenant: next, k: k}
			}
		}
	}
}

// stop closes every worker's limiters and client (the wake-up loops and
// slots end with the context, cancelled before).
func (c *simChild) stop() {
	for _, w := range c.workers {
		for _, l := range w.lims {
			_ = l.Close()
		}
		_ = w.rdb.Close()
	}
}

func (c *simChild) progress() simProgress {
	p := simProgress{Counts: c.counts.snap(), BusyRuns: c.busyRuns.Load(), BusyParks: c.busyParks.Load(),
		HoldRuns: c.holdRuns.Load(), HoldParks: c.holdParks.Load(), ParkedNow: c.parkedNow.Load(),
		Fallbacks: c.fallbacks.Load(), Errors: c.errs.Load(), LookErrors: c.lookErrs.Load(), CPUNs: cpuTime()}
	if e := c.firstErr.Load(); e != nil {
		p.FirstError = *e
	}
	return p
}
