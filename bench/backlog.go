package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The backlog part measures issue 9's targets for parking, beside the
// deferral that books nothing (waitOnly), in the same run: a backlog of one
// subject, a hot subject ahead of a cold one, and a paced batch whose fleet
// is stopped and restarted. Every worker is an asynq server in this
// process on a throwaway redis-server (see fleet.go).

// backlogResult is the part's JSON: results/<date>-backlog.json.
type backlogResult struct {
	partHead
	Config   backlogConfig `json:"config"`
	RuntimeS float64       `json:"runtime_s"`
	Backlog  []*backlogRun `json:"backlog"`
	HotCold  []*hotColdRun `json:"hot_cold"`
	Restart  []*restartRun `json:"restart"`
	Errors   []string      `json:"errors,omitempty"`
}

type backlogConfig struct {
	Modes []string `json:"modes"`
	// Backlog: one subject, GCRA burst 1.
	Servers     int           `json:"backlog_servers"`
	Concurrency int           `json:"backlog_concurrency"`
	MaxWaitS    float64       `json:"backlog_max_wait_s"`
	Sizes       []backlogSize `json:"backlog_sizes"`
	// CapFactor stops a backlog run (and a hot/cold run's wait for its hot
	// tasks) at CapFactor × N/R plus CapSlackS.
	CapFactor float64 `json:"cap_factor"`
	CapSlackS float64 `json:"cap_slack_s"`
	// Hot and cold: one server, a per-tenant GCRA rule, burst 1.
	HotConcurrency int           `json:"hot_concurrency"`
	HotSizes       []backlogSize `json:"hot_sizes"`
	Cold           int           `json:"cold"`
	HotMaxWaitsS   []float64     `json:"hot_max_waits_s"`
	// Restart: a paced batch, the fleet stopped mid-run.
	RestartServers     int     `json:"restart_servers"`
	RestartConcurrency int     `json:"restart_concurrency"`
	RestartTasks       int     `json:"restart_tasks"`
	RestartRate        int     `json:"restart_rate"`
	RestartStopAfterS  float64 `json:"restart_stop_after_s"`
	RestartDownS       float64 `json:"restart_down_s"`
	RestartMaxWaitS    float64 `json:"restart_max_wait_s"`
	Nice               int     `json:"nice"`
}

type backlogSize struct {
	N    int `json:"n"`
	Rate int `json:"rate"`
	// Concurrency per server, if not the config's.
	Concurrency int `json:"concurrency,omitempty"`
}

// backlogRun is one backlog of N tasks at R/s under one mode.
type backlogRun struct {
	Mode        string  `json:"mode"`
	N           int     `json:"n"`
	Rate        int     `json:"rate"`
	Servers     int     `json:"servers"`
	Concurrency int     `json:"concurrency"` // per server
	IdealS      float64 `json:"ideal_s"`     // N/R
	TargetS     float64 `json:"target_s"`    // N/R × 1.02 + 2 s
	CapS        float64 `json:"cap_s"`       // when the run is stopped if not done
	EnqueueS    float64 `json:"enqueue_s"`
	Done        int     `json:"done"`     // distinct tasks started
	Finished    bool    `json:"finished"` // all N started before the cap
	// TookS is from the first enqueue to the last handler start (if
	// finished; else the cap).
	TookS float64 `json:"took_s"`
	counts
	// Most in any 1 s: turns on the Redis clock (-1: no turns, deferral)
	// and handler starts on the local clock; Bound is R + burst.
	MaxTurns1s  int `json:"max_turns_1s"`
	MaxStarts1s int `json:"max_starts_1s"`
	Bound1s     int `json:"bound_1s"`
	// The turns on the Redis clock (same host: the same clock as the
	// local one): the first after the first enqueue, and from the first
	// to the last (N/R less 1/R if no booked turn was wasted).
	FirstTurnS float64 `json:"first_turn_s,omitempty"`
	TurnSpanS  float64 `json:"turn_span_s,omitempty"`
}

// hotColdRun is Hot tasks of tenant "hot" ahead of Cold of "cold".
type hotColdRun struct {
	Mode     string  `json:"mode"`
	Hot      int     `json:"hot"`
	Rate     int     `json:"rate"`
	Cold     int     `json:"cold"`
	MaxWaitS float64 `json:"max_wait_s"`
	CapS     float64 `json:"cap_s"`
	Done     int     `json:"done"`
	Finished bool    `json:"finished"`
	// Cold tasks, from enqueue to handler start (local clock); ColdMaxS
	// is their p99 (the worst of 10). ColdStarted counts those that ran.
	ColdStarted int     `json:"cold_started"`
	ColdP50S    float64 `json:"cold_p50_s"`
	ColdMaxS    float64 `json:"cold_max_s"`
	// The hot tenant's rate, (k−1)/(last − first) over its k turns on the
	// Redis clock (-1 without turns) and its handler starts, and the
	// fraction of its limit.
	HotRateTurns   float64 `json:"hot_rate_turns"`
	HotRateStarts  float64 `json:"hot_rate_starts"`
	HotPctTurns    float64 `json:"hot_pct_turns"`
	HotPctStarts   float64 `json:"hot_pct_starts"`
	HotMaxTurns1s  int     `json:"hot_max_turns_1s"`
	HotMaxStarts1s int     `json:"hot_max_starts_1s"`
	HotTookS       float64 `json:"hot_took_s"`
	counts
}

// restartRun is a paced batch whose fleet was stopped and restarted.
type restartRun struct {
	Mode       string  `json:"mode"`
	Tasks      int     `json:"tasks"`
	Rate       int     `json:"rate"`
	StopAfterS float64 `json:"stop_after_s"`
	DownS      float64 `json:"down_s"`
	// StartedBefore tasks ran before the stop; the rest after the restart.
	StartedBefore int     `json:"started_before"`
	Done          int     `json:"done"`
	Finished      bool    `json:"finished"`
	AfterS        float64 `json:"after_s"` // from the restart to the last start
	// Most in any 1 s: over the whole run (turns on the Redis clock, -1
	// without; handler starts on the local clock) and over the starts from
	// the restart on.
	MaxTurns1s       int `json:"max_turns_1s"`
	MaxStarts1s      int `json:"max_starts_1s"`
	MaxTurns1sAfter  int `json:"max_turns_1s_after"`
	MaxStarts1sAfter int `json:"max_starts_1s_after"`
	Bound1s          int `json:"bound_1s"`
	counts
}

func defaultBacklogConfig() backlogConfig {
	return backlogConfig{Modes: []string{modeParking, modeDeferral},
		Servers: 3, Concurrency: 20, MaxWaitS: 1,
		// At 500/s, 3 × 20 slots wait 0.12 s at most, less than max_wait:
		// no task parks. 3 × 200 keeps concurrency / rate (1.2 s) above
		// max_wait, as at 50/s.
		Sizes:     []backlogSize{{N: 300, Rate: 5}, {N: 3000, Rate: 50}, {N: 30000, Rate: 500}, {N: 30000, Rate: 500, Concurrency: 200}},
		CapFactor: 2, CapSlackS: 10,
		HotConcurrency: 10, HotSizes: []backlogSize{{N: 100, Rate: 10}, {N: 1000, Rate: 50}}, Cold: 10, HotMaxWaitsS: []float64{1, 30},
		RestartServers: 3, RestartConcurrency: 10, RestartTasks: 100, RestartRate: 5, RestartStopAfterS: 8, RestartDownS: 60, RestartMaxWaitS: 1,
		Nice: niceness}
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// runBacklogPart runs the part and writes results/<date>-backlog.json.
func runBacklogPart(logf func(string, ...any), cfg backlogConfig) error {
	t0 := time.Now()
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &backlogResult{partHead: head, Config: cfg}
	ctx := context.Background()
	fail := func(what string, err error) {
		res.Errors = append(res.Errors, fmt.Sprintf("%s: %v", what, err))
		logf("%s: %v", what, err)
	}
	for _, sz := range cfg.Sizes {
		for _, mode := range cfg.Modes {
			r, err := runBacklogCase(ctx, srv.Addr, mode, sz, cfg)
			if err != nil {
				fail(fmt.Sprintf("backlog %s N=%d", mode, sz.N), err)
				continue
			}
			logf("backlog %-8s N=%-5d R=%-3d %d×%-3d done %d/%d in %.1fs (ideal %.0fs, target %.1fs): %.3f calls, %.3f parks+deferrals, %.3f dequeues, %.0f Redis µs per task; most in 1 s: %d turns, %d starts (bound %d)",
				mode, r.N, r.Rate, r.Servers, r.Concurrency, r.Done, r.N, r.TookS, r.IdealS, r.TargetS, r.CallsPerTask, r.ParksPerTask, r.DequeuesPerTask, r.RedisUsecPerTask, r.MaxTurns1s, r.MaxStarts1s, r.Bound1s)
			res.Backlog = append(res.Backlog, r)
		}
	}
	for _, sz := range cfg.HotSizes {
		for _, mw := range cfg.HotMaxWaitsS {
			for _, mode := range cfg.Modes {
				r, err := runHotColdCase(ctx, srv.Addr, mode, sz, mw, cfg)
				if err != nil {
					fail(fmt.Sprintf("hot/cold %s hot=%d max_wait=%gs", mode, sz.N, mw), err)
					continue
				}
				logf("hot/cold %-8s hot=%-4d R=%-2d max_wait=%-2gs: cold p50 %.2fs max %.2fs (%d/%d ran); hot %.2f/s turns (%.1f %%), %.2f/s starts; %d/%d done",
					mode, r.Hot, r.Rate, r.MaxWaitS, r.ColdP50S, r.ColdMaxS, r.ColdStarted, r.Cold, r.HotRateTurns, r.HotPctTurns, r.HotRateStarts, r.Done, r.Hot+r.Cold)
				res.HotCold = append(res.HotCold, r)
			}
		}
	}
	for _, mode := range cfg.Modes {
		r, err := runRestartCase(ctx, srv.Addr, mode, cfg, logf)
		if err != nil {
			fail(fmt.Sprintf("restart %s", mode), err)
			continue
		}
		logf("restart %-8s %d started before the stop, %d/%d done, %.1fs after the restart; most in 1 s: %d turns, %d starts; from the restart: %d turns, %d starts (bound %d)",
			mode, r.StartedBefore, r.Done, r.Tasks, r.AfterS, r.MaxTurns1s, r.MaxStarts1s, r.MaxTurns1sAfter, r.MaxStarts1sAfter, r.Bound1s)
		res.Restart = append(res.Restart, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, "backlog", res)
}

func gcraRule(name string, rate int) throttle.Rule {
	return throttle.Rule{Name: name, Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)}
}

// runBacklogCase enqueues N tasks of one subject at once to cfg.Servers
// running workers and waits until all have started, or until the cap.
func runBacklogCase(ctx context.Context, addr, mode string, sz backlogSize, cfg backlogConfig) (*backlogRun, error) {
	conc := cmp.Or(sz.Concurrency, cfg.Concurrency)
	f, before, err := openFleet(ctx, addr, fleetSpec{mode: mode, rule: gcraRule("api", sz.Rate), prefix: "bl",
		maxWait: secs(cfg.MaxWaitS), concurrency: conc}, cfg.Servers)
	if err != nil {
		return nil, err
	}
	defer f.close()
	ideal := float64(sz.N) / float64(sz.Rate)
	r := &backlogRun{Mode: mode, N: sz.N, Rate: sz.Rate, Servers: cfg.Servers, Concurrency: conc, IdealS: ideal, TargetS: ideal*1.02 + 2,
		CapS: ideal*cfg.CapFactor + cfg.CapSlackS, Bound1s: sz.Rate + 1}
	t0 := time.Now()
	if err := f.enqueue(ctx, "acme", sz.N, false); err != nil {
		return nil, err
	}
	r.EnqueueS = time.Since(t0).Seconds()
	r.Finished = f.waitStarts(sz.N, t0.Add(secs(r.CapS)))
	starts, err := f.finish(ctx, sz.N, before, &r.counts, &r.Done)
	if err != nil {
		return nil, err
	}
	r.TookS = r.CapS
	if r.Finished {
		r.TookS = lastStart(starts).Sub(t0).Seconds()
	}
	r.MaxStarts1s, r.MaxTurns1s = mostInSecond(starts, "", time.Time{})
	var turns []time.Time
	for _, s := range starts {
		if !s.turn.IsZero() {
			turns = append(turns, s.turn)
		}
	}
	if len(turns) > 0 {
		first, last := slices.MinFunc(turns, time.Time.Compare), slices.MaxFunc(turns, time.Time.Compare)
		r.FirstTurnS, r.TurnSpanS = first.Sub(t0).Seconds(), last.Sub(first).Seconds()
	}
	return r, nil
}

func lastStart(starts []taskStart) time.Time {
	var last time.Time
	for _, s := range starts {
		if s.at.After(last) {
			last = s.at
		}
	}
	return last
}

// runHotColdCase enqueues sz.N tasks of tenant "hot", then cfg.Cold of
// "cold", to one server under a per-tenant rule.
func runHotColdCase(ctx context.Context, addr, mode string, sz backlogSize, maxWait float64, cfg backlogConfig) (*hotColdRun, error) {
	f, before, err := openFleet(ctx, addr, fleetSpec{mode: mode, rule: gcraRule("tenant", sz.Rate), prefix: "hc",
		maxWait: secs(maxWait), concurrency: cfg.HotConcurrency}, 1)
	if err != nil {
		return nil, err
	}
	defer f.close()
	n := sz.N + cfg.Cold
	r := &hotColdRun{Mode: mode, Hot: sz.N, Rate: sz.Rate, Cold: cfg.Cold, MaxWaitS: maxWait,
		CapS: float64(sz.N)/float64(sz.Rate)*cfg.CapFactor + cfg.CapSlackS}
	t0 := time.Now()
	if err := f.enqueue(ctx, "hot", sz.N, false); err != nil {
		return nil, err
	}
	if err := f.enqueue(ctx, "cold", cfg.Cold, true); err != nil {
		return nil, err
	}
	r.Finished = f.waitStarts(n, t0.Add(secs(r.CapS)))
	starts, err := f.finish(ctx, n, before, &r.counts, &r.Done)
	if err != nil {
		return nil, err
	}

	var cold []int64
	var hotAt, hotTurns []time.Time
	f.mu.Lock()
	for _, s := range starts {
		switch s.subject {
		case "cold":
			cold = append(cold, int64(s.at.Sub(f.enqueued[s.id])))
		case "hot":
			hotAt = append(hotAt, s.at)
			if !s.turn.IsZero() {
				hotTurns = append(hotTurns, s.turn)
			}
		}
	}
	f.mu.Unlock()
	slices.Sort(cold)
	r.ColdStarted = len(cold)
	r.ColdP50S, r.ColdMaxS = float64(percentile(cold, 50))/1e9, float64(percentile(cold, 99))/1e9
	if r.ColdStarted < r.Cold {
		r.ColdMaxS = r.CapS // some never ran: at least the cap
	}
	r.HotRateStarts, r.HotRateTurns = spanRate(hotAt), spanRate(hotTurns)
	if len(hotTurns) == 0 {
		r.HotRateTurns = -1
	}
	r.HotPctStarts, r.HotPctTurns = 100*r.HotRateStarts/float64(sz.Rate), 100*r.HotRateTurns/float64(sz.Rate)
	if len(hotAt) > 0 {
		r.HotTookS = lastStart(starts).Sub(t0).Seconds()
	}
	r.HotMaxStarts1s, r.HotMaxTurns1s = mostInSecond(starts, "hot", time.Time{})
	return r, nil
}

// spanRate is (k−1) / (last − first) over k times; 0 for fewer than 2.
func spanRate(ts []time.Time) float64 {
	if len(ts) < 2 {
		return 0
	}
	first, last := slices.MinFunc(ts, time.Time.Compare), slices.MaxFunc(ts, time.Time.Compare)
	if !last.After(first) {
		return 0
	}
	return float64(len(ts)-1) / last.Sub(first).Seconds()
}

// runRestartCase paces a batch through enqueue.Pacer to three servers,
// stops them all mid-run, and starts three new ones after DownS.
func runRestartCase(ctx context.Context, addr, mode string, cfg backlogConfig, logf func(string, ...any)) (*restartRun, error) {
	// With the deferral's waitOnly the middleware cannot redeem the
	// producer's receipts; its workers charge each task on their own
	// key instead, so that the pacer's bookings schedule the tasks and the
	// workers' waits do not take a second turn on the same ledger.
	workerPrefix := "rs"
	if mode == modeDeferral {
		workerPrefix = "rs-workers"
	}
	f, before, err := openFleet(ctx, addr, fleetSpec{mode: mode, rule: gcraRule("api", cfg.RestartRate), prefix: workerPrefix,
		maxWait: secs(cfg.RestartMaxWaitS), concurrency: cfg.RestartConcurrency}, cfg.RestartServers)
	if err != nil {
		return nil, err
	}
	defer f.close()
	pacerRDB := redis.NewClient(&redis.Options{Addr: addr})
	defer pacerRDB.Close()
	pacerLim, err := throttle.New(pacerRDB, throttle.Options{Prefix: "rs"}, f.spec.rule)
	if err != nil {
		return nil, err
	}
	wakeups, err := admission.NewShardedWakeups(f.admin, admission.WakeupsKey, 0) // the workers' default shards
	if err != nil {
		return nil, err
	}
	r := &restartRun{Mode: mode, Tasks: cfg.RestartTasks, Rate: cfg.RestartRate, StopAfterS: cfg.RestartStopAfterS,
		DownS: cfg.RestartDownS, Bound1s: cfg.RestartRate + 1}
	t0 := time.Now()
	batch := enqueue.Batch{Type: "job:call", Count: cfg.RestartTasks, Payloads: [][]byte{[]byte(`{"tenant":"acme"}`)},
		Pacer: &enqueue.Pacer{Limiter: pacerLim, Subject: rules.SubjectConfig{PayloadField: "tenant"}.Of, Wakeups: wakeups}}
	if _, err := batch.Run(ctx, f.cli); err != nil {
		return nil, err
	}
	time.Sleep(time.Until(t0.Add(secs(cfg.RestartStopAfterS))))
	f.stop()
	r.StartedBefore = f.started()
	logf("restart %s: fleet stopped after %.1fs with %d of %d started; back in %gs", mode, time.Since(t0).Seconds(), r.StartedBefore, r.Tasks, cfg.RestartDownS)
	time.Sleep(secs(cfg.RestartDownS))
	back := time.Now()
	if err := f.start(cfg.RestartServers); err != nil {
		return nil, err
	}
	left := float64(cfg.RestartTasks-r.StartedBefore) / float64(cfg.RestartRate)
	r.Finished = f.waitStarts(cfg.RestartTasks, back.Add(secs(left*cfg.CapFactor+cfg.CapSlackS)))
	starts, err := f.finish(ctx, cfg.RestartTasks, before, &r.counts, &r.Done)
	if err != nil {
		return nil, err
	}
	r.AfterS = lastStart(starts).Sub(back).Seconds()
	r.MaxStarts1s, r.MaxTurns1s = mostInSecond(starts, "", time.Time{})
	r.MaxStarts1sAfter, r.MaxTurns1sAfter = mostInSecond(starts, "", back)
	return r, nil
}
