// Command llm-batch runs a batch of LLM calls through the rules file
// rules.yaml, as cmd/worker runs it: each call is charged one request, its
// input tokens and its output tokens in one decision, and settled to the
// answer's usage. By default it calls a fake OpenAI-compatible provider on
// loopback that enforces the file's limits (and answers 429 past any), so
// it needs no key:
//
//	go run ./examples/llm-batch
//
// Set LLM_BASE_URL and LLM_API_KEY (and LLM_MODEL, and LLM_STYLE=anthropic
// for Anthropic's messages API) to call a real provider instead; the key
// is sent in a header and never printed or logged. No Redis is needed: it
// starts an in-memory one on loopback.
package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

//go:embed rules.yaml
var rulesFile []byte

// The base URLs rules.yaml names, which LLM_BASE_URL (or the fake's)
// replaces for the style's task type.
var fileBase = map[llmfake.Style]string{
	llmfake.OpenAI:    "https://api.openai.com/v1",
	llmfake.Anthropic: "https://api.anthropic.com",
}

// config is one run.
type config struct {
	Calls       int
	Style       llmfake.Style
	BaseURL     string // "": the fake provider
	APIKey      string
	Model       string
	MaxTokens   int
	Servers     int // asynq servers (worker processes, in real life)
	Concurrency int // each server's slots
	Timeout     time.Duration
}

// defaults: 30 calls of 150 to 400 input tokens and max_tokens 150, to
// the fake provider, by 2 servers of 4 slots.
var defaults = config{Calls: 30, Style: llmfake.OpenAI, Model: "fake-model", MaxTokens: 150,
	Servers: 2, Concurrency: 4, Timeout: 2 * time.Minute}

// fromEnv reads LLM_STYLE, LLM_BASE_URL, LLM_API_KEY and LLM_MODEL into
// cfg.
func fromEnv(cfg config, getenv func(string) string) (config, error) {
	if s := getenv("LLM_STYLE"); s != "" {
		cfg.Style = llmfake.Style(s)
	}
	if _, ok := fileBase[cfg.Style]; !ok {
		return cfg, fmt.Errorf("llm-batch: LLM_STYLE=%q: use openai (chat completions) or anthropic (messages)", cfg.Style)
	}
	cfg.BaseURL = strings.TrimSuffix(getenv("LLM_BASE_URL"), "/")
	cfg.APIKey = getenv("LLM_API_KEY")
	if cfg.BaseURL != "" {
		if !strings.HasPrefix(cfg.BaseURL, "http://") && !strings.HasPrefix(cfg.BaseURL, "https://") {
			return cfg, errors.New("llm-batch: LLM_BASE_URL must start with http:// or https://, such as https://api.openai.com/v1")
		}
		if cfg.APIKey == "" {
			return cfg, errors.New("llm-batch: LLM_BASE_URL is set but LLM_API_KEY is not; set the provider's key")
		}
		cfg.Model = ""
	}
	if m := getenv("LLM_MODEL"); m != "" {
		cfg.Model = m
	}
	if cfg.Model == "" {
		return cfg, errors.New("llm-batch: set LLM_MODEL to a model of the provider, such as gpt-4o-mini or claude-haiku-4-5")
	}
	return cfg, nil
}

func main() {
	log.SetFlags(0)
	cfg := defaults
	flag.IntVar(&cfg.Calls, "calls", cfg.Calls, "LLM calls in the batch")
	flag.Parse()
	cfg, err := fromEnv(cfg, os.Getenv)
	if err != nil {
		log.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	res, err := run(context.Background(), cfg, os.Stdout, logger)
	if err != nil {
		log.Fatal(err)
	}
	res.print(os.Stdout)
	if res.Completed != cfg.Calls || res.Rejected > 0 {
		os.Exit(1)
	}
}

// run drains one batch; progress goes to out, the workers' warnings to
// logger.
func run(ctx context.Context, cfg config, out io.Writer, logger *slog.Logger) (*result, error) {
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer dev.Close()
	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()

	var fake *llmfake.Provider
	base, key := cfg.BaseURL, cfg.APIKey
	if base == "" {
		var stop func()
		if fake, base, stop, err = startFake(cfg.Style); err != nil {
			return nil, err
		}
		defer stop()
		key = "fake-key"
		fmt.Fprintf(out, "llm-batch: %d calls to a fake %s provider at %s that enforces rules.yaml's limits\n", cfg.Calls, cfg.Style, base)
	} else {
		fmt.Fprintf(out, "llm-batch: %d calls to %s (%s, model %s)\n", cfg.Calls, base, cfg.Style, cfg.Model)
	}
	rc, hs, err := load(base, cfg.Style)
	if err != nil {
		return nil, err
	}
	getenv := func(name string) string {
		if name == "LLM_API_KEY" {
			return key
		}
		return ""
	}
	stop, err := startWorkers(cfg, dev.Addr(), rc, hs, getenv, logger)
	if err != nil {
		return nil, err
	}
	defer stop()

	start := time.Now()
	if err := enqueue(rdb, cfg); err != nil {
		return nil, err
	}
	if err := wait(ctx, rdb, cfg, out, start); err != nil {
		return nil, err
	}
	return measure(rdb, cfg, rc, fake, start)
}

// startFake starts the fake provider on loopback, enforcing rules.yaml's
// limits with buckets of 12 seconds of each rate (the workers' bursts are
// 10 seconds): it returns the provider, its base URL and how to stop it.
func startFake(style llmfake.Style) (*llmfake.Provider, string, func(), error) {
	rc, err := rules.Parse("rules.yaml", rulesFile)
	if err != nil {
		return nil, "", nil, err
	}
	lim := llmfake.Limits{Hold: 12 * time.Second}
	for _, l := range rc.Rules[0].Limits {
		lim.Period = l.Limit.Period
		switch l.Name {
		case "requests":
			lim.Requests = l.Limit.Count
		case "input":
			lim.Input = l.Limit.Count
		case "output":
			lim.Output = l.Limit.Count
		}
	}
	fake := llmfake.New(style, lim, 200*time.Millisecond)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", nil, err
	}
	srv := &http.Server{Handler: fake, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	base := "http://" + ln.Addr().String()
	if style == llmfake.OpenAI {
		base += "/v1"
	}
	return fake, base, func() { srv.Close() }, nil
}

// load parses rules.yaml with the style's base URL replaced by base.
func load(base string, style llmfake.Style) (*rules.Config, *handler.Config, error) {
	data := strings.ReplaceAll(string(rulesFile), `"`+fileBase[style]+`/`, `"`+base+`/`)
	rc, err := rules.Parse("rules.yaml", []byte(data))
	if err != nil {
		return nil, nil, err
	}
	hs, err := handler.FromRules(rc)
	return rc, hs, err
}

// startWorkers starts cfg.Servers asynq servers, each with its own Redis
// client, its middleware and its handlers, as cmd/worker builds them; the
// function returned stops them.
func startWorkers(cfg config, addr string, rc *rules.Config, hs *handler.Config, getenv func(string) string, logger *slog.Logger) (func(), error) {
	var stops []func()
	// Servers first, then middlewares, then clients.
	stop := func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	for range cfg.Servers {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		stops = append(stops, func() { rdb.Close() })
		mw, err := worker.FromRules(rc, rdb, worker.Options{Asynq: rdb, Logger: logger, MaxWaiting: max(cfg.Concurrency/2, 1)})
		if err != nil {
			stop()
			return nil, err
		}
		stops = append(stops, func() { _ = mw.Close() })
		mux := asynq.NewServeMux()
		if err := hs.Register(mux, handler.Options{Rules: rc, Redis: rdb, Getenv: getenv, Logger: logger,
			SetCost: worker.SetCost, SetCosts: worker.SetCosts}); err != nil {
			stop()
			return nil, err
		}
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{Concurrency: cfg.Concurrency, LogLevel: asynq.ErrorLevel}))
		if err := srv.Start(mw.Wrap(mux)); err != nil {
			stop()
			return nil, err
		}
		stops = append(stops, srv.Shutdown)
	}
	return stop, nil
}
