package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// The llm-backlog part measures issue 23's item 2 with real asynq
// workers: a parked backlog of LLM calls whose estimates are 40 % above
// their real token counts, each charged requests 1, input and output
// tokens in one decision (worker.TaskRule.Costs), and settled to its real
// counts when its handler returns (worker.SetCosts), beside the same
// backlog not settled. What it records: the share of the binding
// (input-token) limit used, past its opening burst; parks and limiter
// calls per task.

// llmBacklogConfig is the part's configuration.
type llmBacklogConfig struct {
	Tasks       int     `json:"tasks"`
	Servers     int     `json:"servers"`     // asynq servers in this process, each with its own clients
	Concurrency int     `json:"concurrency"` // per server
	Requests    int     `json:"requests_per_s"`
	Input       int     `json:"input_tokens_per_s"` // binds
	Output      int     `json:"output_tokens_per_s"`
	BurstS      float64 `json:"burst_s"`    // every limit's burst, in seconds of its rate
	Overrate    float64 `json:"estimate_x"` // estimate / real
}

func defaultLLMBacklogConfig() llmBacklogConfig {
	return llmBacklogConfig{Tasks: 2000, Servers: 3, Concurrency: 20, Requests: 100, Input: 6000, Output: 6000, BurstS: 5, Overrate: 1.4}
}

// llmBacklogRun is one backlog, settled or not.
type llmBacklogRun struct {
	Settled       bool    `json:"settled"`
	Done          int     `json:"done"`
	SpanS         float64 `json:"span_s"` // first start to last start
	InputUsed     int     `json:"input_tokens_used"`
	InputBurst    int     `json:"input_burst"`
	UsedPastBurst float64 `json:"used_past_burst"` // (used − burst) / (rate × span)
	MostIn1s      int     `json:"most_input_in_1s"`
	CallsPerTask  float64 `json:"limiter_calls_per_task"`
	ParksPerTask  float64 `json:"parks_per_task"`
	Redeemed      int     `json:"ran_on_a_booked_turn"`
}

type llmBacklogResult struct {
	partHead
	Config   llmBacklogConfig `json:"config"`
	RuntimeS float64          `json:"runtime_s"`
	Runs     []*llmBacklogRun `json:"runs"`
	Errors   []string         `json:"errors,omitempty"`
}

func runLLMBacklogPart(logf func(string, ...any), cfg llmBacklogConfig) error {
	t0 := time.Now()
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &llmBacklogResult{partHead: head, Config: cfg}
	for _, settled := range []bool{true, false} {
		r, err := runLLMBacklog(context.Background(), srv.Addr, cfg, settled)
		if err != nil {
			res.Errors = append(res.Errors, fmt.Sprintf("settled=%v: %v", settled, err))
			logf("llm-backlog settled=%v: %v", settled, err)
			continue
		}
		logf("llm-backlog settled=%-5v %d/%d done in %.1fs: %d input tokens, %.1f %% of the rate past the burst of %d; most in 1 s %d; %.3f limiter calls, %.3f parks per task; %d ran on a booked turn",
			r.Settled, r.Done, cfg.Tasks, r.SpanS, r.InputUsed, 100*r.UsedPastBurst, r.InputBurst, r.MostIn1s, r.CallsPerTask, r.ParksPerTask, r.Redeemed)
		res.Runs = append(res.Runs, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, "llm-backlog", res)
}

// llmCall is a task's payload: its estimates, and what the call will
// really use (which the handler learns only from the answer).
type llmCall struct {
	EstIn, EstOut   int
	RealIn, RealOut int
}

// llmStart is one handler start: when, and the input tokens it used.
type llmStart struct {
	at       time.Time
	input    int
	redeemed bool
}

// llmFleet is the workers of one run and what they saw.
type llmFleet struct {
	addr         string
	rules        []throttle.Rule
	settled      bool
	concurrency  int
	calls, parks atomic.Int64
	mu           sync.Mutex
	starts       []llmStart
	closers      []func()
}

// startServer starts one asynq server, with its own clients and limiter,
// whose rule charges each task its estimates per limit.
func (f *llmFleet) startServer() error {
	limRDB := redis.NewClient(&redis.Options{Addr: f.addr})
	limRDB.AddHook(scriptCount{&f.calls})
	rdb := redis.NewClient(&redis.Options{Addr: f.addr})
	f.closers = append(f.closers, func() { limRDB.Close(); rdb.Close() })
	lim, err := throttle.New(limRDB, throttle.Options{}, f.rules...)
	if err != nil {
		return err
	}
	mw, err := worker.NewMiddleware([]worker.TaskRule{{Name: "llm", Tasks: []string{"llm:*"}, Limiter: lim, Subject: worker.Fixed("api"),
		Costs: func(t *asynq.Task) (throttle.Costs, error) {
			var c llmCall
			err := json.Unmarshal(t.Payload(), &c)
			return throttle.Costs{1, c.EstIn, c.EstOut}, err
		}}}, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("llm:call", f.handle)
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency: f.concurrency, LogLevel: asynq.FatalLevel, ShutdownTimeout: 2 * time.Second,
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			if errors.Is(err, worker.ErrParked) {
				f.parks.Add(1)
			}
		}),
	}))
	if err := srv.Start(mux); err != nil {
		return err
	}
	f.closers = append(f.closers, func() {
		srv.Stop()
		mw.Drain()
		srv.Shutdown()
		_ = lim.Close()
	})
	return nil
}

// handle is a call: it records its start and, if the run settles, reports
// its real counts, which it learns only now.
func (f *llmFleet) handle(ctx context.Context, t *asynq.Task) error {
	var c llmCall
	_ = json.Unmarshal(t.Payload(), &c)
	w, _ := admission.WaitedFrom(ctx)
	f.mu.Lock()
	f.starts = append(f.starts, llmStart{at: time.Now(), input: c.RealIn, redeemed: w.Redeemed})
	f.mu.Unlock()
	if f.settled {
		return worker.SetCosts(ctx, throttle.Costs{1, c.RealIn, c.RealOut})
	}
	return nil
}

// close stops the servers, the last started first.
func (f *llmFleet) close() {
	for i := len(f.closers) - 1; i >= 0; i-- {
		f.closers[i]()
	}
}

// runLLMBacklog enqueues the backlog at once to cfg.Servers workers and
// waits for every task to start (or for four times its ideal time).
func runLLMBacklog(ctx context.Context, addr string, cfg llmBacklogConfig, settled bool) (*llmBacklogRun, error) {
	admin := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 32})
	defer admin.Close()
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return nil, err
	}
	burst := func(rate int) int { return int(float64(rate) * cfg.BurstS) }
	f := &llmFleet{addr: addr, settled: settled, concurrency: cfg.Concurrency, rules: []throttle.Rule{
		{Name: "llm.requests", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(cfg.Requests).WithBurst(burst(cfg.Requests))},
		{Name: "llm.input", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(cfg.Input).WithBurst(burst(cfg.Input))},
		{Name: "llm.output", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(cfg.Output).WithBurst(burst(cfg.Output))},
	}}
	defer f.close()
	for range cfg.Servers {
		if err := f.startServer(); err != nil {
			return nil, err
		}
	}
	cli := asynq.NewClientFromRedisClient(admin)
	rng := rand.New(rand.NewPCG(23, 2))
	realIn := 0
	for range cfg.Tasks {
		c := llmCall{RealIn: 100 + rng.IntN(201), RealOut: 50 + rng.IntN(101)}
		c.EstIn, c.EstOut = int(float64(c.RealIn)*cfg.Overrate), int(float64(c.RealOut)*cfg.Overrate)
		realIn += c.RealIn
		payload, _ := json.Marshal(c)
		if _, err := cli.Enqueue(asynq.NewTask("llm:call", payload), asynq.MaxRetry(1000)); err != nil {
			return nil, err
		}
	}
	ideal := time.Duration(float64(realIn) / float64(cfg.Input) * float64(time.Second))
	deadline := time.Now().Add(4*ideal + 30*time.Second)
	for {
		f.mu.Lock()
		n := len(f.starts)
		f.mu.Unlock()
		if n >= cfg.Tasks || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return llmBacklogSummary(cfg, settled, f.starts, f.calls.Load(), f.parks.Load()), nil
}

// llmBacklogSummary measures a run from its handler starts.
func llmBacklogSummary(cfg llmBacklogConfig, settled bool, starts []llmStart, calls, parks int64) *llmBacklogRun {
	r := &llmBacklogRun{Settled: settled, Done: len(starts), InputBurst: int(float64(cfg.Input) * cfg.BurstS),
		CallsPerTask: float64(calls) / float64(cfg.Tasks), ParksPerTask: float64(parks) / float64(cfg.Tasks)}
	if len(starts) < 2 {
		return r
	}
	first, last := starts[0].at, starts[0].at
	for _, s := range starts {
		r.InputUsed += s.input
		if s.at.Before(first) {
			first = s.at
		}
		if s.at.After(last) {
			last = s.at
		}
		if s.redeemed {
			r.Redeemed++
		}
	}
	span := last.Sub(first)
	r.SpanS = span.Seconds()
	r.UsedPastBurst = (float64(r.InputUsed) - float64(r.InputBurst)) / (float64(cfg.Input) * span.Seconds())
	for _, s := range starts {
		in := 0
		for _, o := range starts {
			if !o.at.Before(s.at) && o.at.Sub(s.at) < time.Second {
				in += o.input
			}
		}
		r.MostIn1s = max(r.MostIn1s, in)
	}
	return r
}
