package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// The llm-provider part measures issue 23 end to end: LLM calls run by
// cmd/worker's http handler (llm: true) against a fake provider
// (internal/llmfake) that enforces requests and token limits per window
// (a minute scaled down to Period), answers 429 past any of them, sends
// one provider's headers and returns a usage the workers cannot know in
// advance. Per provider style, three runs of the same 2,000 calls
// enqueued at once to 3 asynq servers: the limits configured in the rules
// file (the provider's own), the limits not configured (the file's ten
// times the provider's, which the workers learn from its headers), and
// a per-process x/time/rate limiter in each worker at a third of the
// provider's limits (charging the estimates: it cannot settle).

// llmProviderConfig is the part's configuration; the limits are per
// Period.
type llmProviderConfig struct {
	Tasks       int           `json:"tasks"`
	Servers     int           `json:"servers"`
	Concurrency int           `json:"concurrency"` // per server
	Period      time.Duration `json:"period_ns"`   // the provider's window (a minute, scaled down)
	Requests    int           `json:"requests"`
	Input       int           `json:"input_tokens"`  // Anthropic style
	Output      int           `json:"output_tokens"` // Anthropic style
	Tokens      int           `json:"tokens"`        // OpenAI style: input and output together
	Latency     time.Duration `json:"latency_ns"`    // the provider's answer time, at most
}

func defaultLLMProviderConfig() llmProviderConfig {
	return llmProviderConfig{Tasks: 2000, Servers: 3, Concurrency: 20, Period: 6 * time.Second,
		Requests: 400, Input: 60000, Output: 60000, Tokens: 90000, Latency: 100 * time.Millisecond}
}

// The modes of a run.
const (
	modeConfigured = "configured"  // the rules file has the provider's limits
	modeLearned    = "learned"     // ten times them: learned from the headers
	modeXRate      = "x/time/rate" // a per-process limiter in each worker
)

// llmProviderRun is one run.
type llmProviderRun struct {
	Style        string             `json:"style"`
	Mode         string             `json:"mode"`
	Done         int                `json:"done"`
	Answered     int                `json:"answered"`
	Rejected     int                `json:"rejected_429"`
	RejectedPct  float64            `json:"rejected_pct"`
	SpanS        float64            `json:"span_s"`
	Used         map[string]float64 `json:"used"` // per limit: used / (window's worth + rate × span)
	Binding      string             `json:"binding"`
	BindingUsed  float64            `json:"binding_used"`
	ParksPerTask float64            `json:"parks_per_task"`
	CallsPerTask float64            `json:"limiter_calls_per_task"`
	// CallsByOp splits CallsPerTask by the script's operation (its
	// ARGV[1], opHook: admit, settle, depart, learn limits …; other, the
	// pause read of a task that waited for its slot, which has none).
	CallsByOp map[string]float64 `json:"limiter_calls_per_task_by_op,omitempty"`
}

type llmProviderResult struct {
	partHead
	Config   llmProviderConfig `json:"config"`
	RuntimeS float64           `json:"runtime_s"`
	Runs     []*llmProviderRun `json:"runs"`
	Errors   []string          `json:"errors,omitempty"`
}

// runLLMProviderPart runs the part's cases whose name ("<style> <mode>")
// matches only (all if empty) and writes results/<date>-<out>.json.
func runLLMProviderPart(logf func(string, ...any), cfg llmProviderConfig, only, out string) error {
	match, err := regexp.Compile(only)
	if err != nil {
		return fmt.Errorf("-learn-only: %w", err)
	}
	t0 := time.Now()
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &llmProviderResult{partHead: head, Config: cfg}
	for _, style := range []llmfake.Style{llmfake.OpenAI, llmfake.Anthropic} {
		for _, mode := range []string{modeConfigured, modeLearned, modeXRate} {
			if !match.MatchString(string(style) + " " + mode) {
				continue
			}
			r, err := runLLMProvider(context.Background(), srv.Addr, cfg, style, mode)
			if err != nil {
				res.Errors = append(res.Errors, fmt.Sprintf("%s %s: %v", style, mode, err))
				logf("llm-provider %s %s: %v", style, mode, err)
				continue
			}
			logf("llm-provider %-9s %-11s limiter calls per task by operation: %v", r.Style, r.Mode, r.CallsByOp)
			logf("llm-provider %-9s %-11s %d/%d done in %.1fs: %s binds, %.1f %% used; 429s %d (%.2f %%); %.2f parks, %.2f limiter calls per task",
				r.Style, r.Mode, r.Done, cfg.Tasks, r.SpanS, r.Binding, 100*r.BindingUsed, r.Rejected, r.RejectedPct, r.ParksPerTask, r.CallsPerTask)
			res.Runs = append(res.Runs, r)
		}
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, out, res)
}

// providerLimits are the fake's limits in style.
func (cfg llmProviderConfig) providerLimits(style llmfake.Style) llmfake.Limits {
	l := llmfake.Limits{Requests: cfg.Requests, Period: cfg.Period}
	if style == llmfake.OpenAI {
		l.Tokens = cfg.Tokens
	} else {
		l.Input, l.Output = cfg.Input, cfg.Output
	}
	return l
}

// rulesFile is the workers' rules file: the provider's limits times
// scale, each with a window's worth of burst, as the provider's buckets.
func (cfg llmProviderConfig) rulesFile(style llmfake.Style, url string, scale int) string {
	limit := func(name string, n int, cost string) string {
		return fmt.Sprintf("      - {name: %s, algorithm: gcra, limit: %d, period: %v, burst: %d%s}\n", name, n*scale, cfg.Period, n*scale, cost)
	}
	var b strings.Builder
	b.WriteString("prefix: \"llmp:\"\nrules:\n  - name: llm\n    tasks: [\"llm:call\"]\n    subject: {fixed: provider}\n    limits:\n")
	b.WriteString(limit("requests", cfg.Requests, ""))
	path := "messages"
	if style == llmfake.OpenAI {
		path = "chat/completions"
		b.WriteString(limit("tokens", cfg.Tokens, ", cost: {estimate: total_tokens}"))
	} else {
		b.WriteString(limit("input", cfg.Input, ", cost: {estimate: input_tokens}"))
		b.WriteString(limit("output", cfg.Output, ", cost: {estimate: output_tokens}"))
	}
	fmt.Fprintf(&b, "handlers:\n  - task: llm:call\n    http:\n      url: \"%s/v1/%s\"\n      headers: {Authorization: \"Bearer k\", X-Api-Key: k}\n      llm: true\n      limit_window: %v\n      timeout: 10s\n", url, path, cfg.Period)
	return b.String()
}

// llmProviderFleet is the workers of one run.
type llmProviderFleet struct {
	cfg          llmProviderConfig
	addr, url    string
	mode         string
	style        llmfake.Style
	rc           *rules.Config
	hs           *handler.Config
	calls, parks atomic.Int64
	ops          *opHook // the limiters' script calls by operation
	closers      []func()
}

// startServer starts one asynq server (a worker process) with its own
// Redis clients: its limiter's client counts the script calls.
func (f *llmProviderFleet) startServer() error {
	limRDB := redis.NewClient(&redis.Options{Addr: f.addr})
	limRDB.AddHook(scriptCount{&f.calls})
	limRDB.AddHook(f.ops)
	rdb := redis.NewClient(&redis.Options{Addr: f.addr})
	f.closers = append(f.closers, func() { limRDB.Close(); rdb.Close() })
	var h asynq.Handler
	var mw *worker.Middleware
	if f.mode == modeXRate {
		h = newXRateWorker(f.cfg, f.style, f.url)
	} else {
		var err error
		log := slog.New(slog.DiscardHandler)
		if mw, err = worker.FromRules(f.rc, limRDB, worker.Options{Asynq: rdb, Logger: log, MaxWaiting: f.cfg.Concurrency / 2}); err != nil {
			return err
		}
		mux := asynq.NewServeMux()
		if err := f.hs.Register(mux, handler.Options{Rules: f.rc, Redis: limRDB, Logger: log, SetCost: worker.SetCost, SetCosts: worker.SetCosts}); err != nil {
			return err
		}
		h = mw.Wrap(mux)
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency: f.cfg.Concurrency, LogLevel: asynq.FatalLevel, ShutdownTimeout: 2 * time.Second,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			if errors.Is(err, worker.ErrParked) {
				f.parks.Add(1)
			}
		}),
	}))
	if err := srv.Start(h); err != nil {
		return err
	}
	f.closers = append(f.closers, func() {
		srv.Stop()
		if mw != nil {
			mw.Drain()
		}
		srv.Shutdown()
	})
	return nil
}

func (f *llmProviderFleet) close() {
	for i := len(f.closers) - 1; i >= 0; i-- {
		f.closers[i]()
	}
}

// llmPayloads are the run's calls: messages of 200 to 2,000 bytes of
// text (about 50 to 500 input tokens), max_tokens 50 to 400.
func llmPayloads(n int) [][]byte {
	rng := rand.New(rand.NewPCG(23, 5))
	words := []string{"limit", "token", "worker", "provider", "request", "budget", "minute", "settle", "answer", "queue"}
	out := make([][]byte, n)
	for i := range out {
		var b strings.Builder
		for size := 200 + rng.IntN(1801); b.Len() < size; {
			b.WriteString(words[rng.IntN(len(words))] + " ")
		}
		out[i], _ = json.Marshal(map[string]any{"model": "m", "max_tokens": 50 + rng.IntN(351),
			"messages": []map[string]string{{"role": "user", "content": b.String()}}})
	}
	return out
}

// runLLMProvider runs the calls once against a new fake provider, and
// waits until every call is done (or for four times the ideal time).
func runLLMProvider(ctx context.Context, addr string, cfg llmProviderConfig, style llmfake.Style, mode string) (*llmProviderRun, error) {
	admin := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 32})
	defer admin.Close()
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return nil, err
	}
	fake := llmfake.New(style, cfg.providerLimits(style), cfg.Latency)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	hsrv := &http.Server{Handler: fake, ReadHeaderTimeout: 5 * time.Second}
	go hsrv.Serve(ln)
	defer hsrv.Close()
	f := &llmProviderFleet{cfg: cfg, addr: addr, url: "http://" + ln.Addr().String(), mode: mode, style: style, ops: &opHook{n: map[string]int64{}}}
	scale := 1
	if mode == modeLearned {
		scale = 10
	}
	if f.rc, err = rules.Parse("rules.yaml", []byte(cfg.rulesFile(style, f.url, scale))); err != nil {
		return nil, err
	}
	if f.hs, err = handler.FromRules(f.rc); err != nil {
		return nil, err
	}
	defer f.close()
	for range cfg.Servers {
		if err := f.startServer(); err != nil {
			return nil, err
		}
	}
	cli := asynq.NewClientFromRedisClient(admin)
	for _, p := range llmPayloads(cfg.Tasks) {
		if _, err := cli.Enqueue(asynq.NewTask("llm:call", p), asynq.MaxRetry(1000), asynq.Retention(time.Hour)); err != nil {
			return nil, err
		}
	}
	insp := asynq.NewInspectorFromRedisClient(admin)
	deadline := time.Now().Add(3 * time.Minute)
	done := 0
	for time.Now().Before(deadline) {
		if q, err := insp.GetQueueInfo("default"); err == nil {
			if done = q.Completed; done >= cfg.Tasks {
				break
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	r := llmProviderSummary(cfg, style, mode, done, fake.Stats(), f.calls.Load(), f.parks.Load())
	if mode != modeXRate {
		r.CallsByOp = map[string]float64{}
		for op, n := range f.ops.counts() {
			r.CallsByOp[op] = float64(n) / float64(cfg.Tasks)
		}
	}
	return r, nil
}

// llmProviderSummary measures a run from what the provider saw.
func llmProviderSummary(cfg llmProviderConfig, style llmfake.Style, mode string, done int, s llmfake.Stats, calls, parks int64) *llmProviderRun {
	r := &llmProviderRun{Style: string(style), Mode: mode, Done: done, Answered: s.Answered, Rejected: s.Rejected,
		SpanS: s.Last.Sub(s.First).Seconds(), Used: map[string]float64{},
		ParksPerTask: float64(parks) / float64(cfg.Tasks), CallsPerTask: float64(calls) / float64(cfg.Tasks)}
	if s.Answered+s.Rejected > 0 {
		r.RejectedPct = 100 * float64(s.Rejected) / float64(s.Answered+s.Rejected)
	}
	lim := cfg.providerLimits(style)
	for _, l := range []struct {
		name       string
		limit, use int
	}{
		{"requests", lim.Requests, s.Answered}, {"input", lim.Input, s.Input},
		{"output", lim.Output, s.Output}, {"tokens", lim.Tokens, s.Input + s.Output},
	} {
		if l.limit == 0 {
			continue
		}
		// What the provider allowed from the first call to the last: its
		// bucket's window's worth, then its rate.
		allowed := float64(l.limit) * (1 + r.SpanS/cfg.Period.Seconds())
		r.Used[l.name] = float64(l.use) / allowed
		if r.Used[l.name] > r.BindingUsed {
			r.Binding, r.BindingUsed = l.name, r.Used[l.name]
		}
	}
	return r
}

// discard drains and closes a response body.
func discard(resp *http.Response) {
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}
