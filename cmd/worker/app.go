package main

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"net"
	"runtime"
	"slices"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// app is what a worker builds from its flags and rules file before it
// serves: the middleware, the handlers (the demo ones too, if on), the
// /readyz check and the metrics registry.
type app struct {
	reg      *prometheus.Registry
	mw       *worker.Middleware
	demo     *demo // nil without the demo
	ready    func(context.Context) error
	reloader *reloader
	status   *status // the status page (status.go)
	quotas   *worker.QuotaCollector
}

// validate checks all that start checks before it connects to Redis, and
// is all that --check does: the form of the Redis URL, the rules file, and
// everything built from it, as build builds it: the middleware's rules,
// the handlers (their ${VAR}s set, their programs on $PATH) and the demo.
// So a file that passes --check starts, short of Redis, and start refuses a
// bad one before it connects anywhere. It connects to nothing: it builds
// on a Redis client that fails every command before it dials (the wake-up
// loop's first calls fail, unlogged), and closes what it built.
func validate(o options, getenv func(string) string) (*rules.Config, *handler.Config, error) {
	cfg, hs, err := loadRules(o.config)
	if err != nil {
		return nil, nil, err
	}
	if o.redisURL != "" {
		rdb, err := redisurl.Open(o.redisURL) // go-redis dials at the first command
		if err != nil {
			return nil, nil, usageError{err}
		}
		_ = rdb.Close()
	}
	offline := redis.NewClient(&redis.Options{Addr: "127.0.0.1:0"})
	offline.AddHook(offlineHook{})
	defer offline.Close()
	a, err := build(o, cfg, hs, offline, getenv, slog.New(slog.DiscardHandler))
	if err != nil {
		return nil, nil, err
	}
	a.close()
	return cfg, hs, nil
}

// errOffline is what validate's Redis client answers, were it ever asked.
var errOffline = errors.New("worker: checking the rules connects to no Redis")

// offlineHook fails every command of a go-redis client before it takes a
// connection, so the client never dials (nor logs a failed dial).
type offlineHook struct{}

func (offlineHook) DialHook(redis.DialHook) redis.DialHook {
	return func(context.Context, string, string) (net.Conn, error) { return nil, errOffline }
}

func (offlineHook) ProcessHook(redis.ProcessHook) redis.ProcessHook {
	return func(_ context.Context, cmd redis.Cmder) error {
		cmd.SetErr(errOffline)
		return errOffline
	}
}

func (offlineHook) ProcessPipelineHook(redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(_ context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			cmd.SetErr(errOffline)
		}
		return errOffline
	}
}

// build builds the app on rdb; the middleware's wake-up loop of parked
// tasks starts on it at once. Mistakes in the rules file, and in the
// environment its handlers need, are usageErrors.
func build(o options, cfg *rules.Config, hs *handler.Config, rdb redis.UniversalClient, getenv func(string) string, log *slog.Logger) (_ *app, err error) {
	a := &app{reg: prometheus.NewRegistry()}
	a.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := worker.NewMetrics(a.reg)
	if err != nil {
		return nil, err
	}
	hmetrics, err := handler.NewMetrics(a.reg)
	if err != nil {
		return nil, err
	}
	// What reaches Redis for jobthrottle, by script and command
	// (jobthrottle_redis_calls_total): rdb is this app's alone.
	metrics.CountRedisCalls(rdb, cfg.Prefix)
	// The queues' sizes are read from Redis when /metrics is scraped, never otherwise.
	queues, err := worker.NewQueueCollector(rdb, slices.Sorted(maps.Keys(o.queues)), worker.LedgerShards(o.wakeupShards))
	if err != nil {
		return nil, usageError{err}
	}
	a.reg.MustRegister(queues)
	// What remains of the calendar quotas is read when /metrics is scraped,
	// or the status page shown, never otherwise.
	if a.quotas, err = worker.NewQuotaCollector(rdb, cfg); err != nil {
		return nil, usageError{err}
	}
	a.reg.MustRegister(a.quotas)
	// Half the slots at most wait for turns, so the other half always
	// serves tasks that can run, however many subjects are over their limits.
	wopts := worker.Options{Logger: log, Metrics: metrics, Asynq: rdb, MaxWaiting: max(concurrency(o)/2, 1), WakeupShards: o.wakeupShards}
	if a.mw, err = worker.FromRules(cfg, rdb, wopts); err != nil {
		a.quotas.Close()
		return nil, usageError{err}
	}
	defer func() {
		if err != nil {
			a.close()
		}
	}()
	if o.demo {
		if a.demo, err = newDemo(rdb, cfg.Prefix, o.demoAPIRate, log); err != nil {
			return nil, usageError{err}
		}
	}
	if a.ready, err = readiness(rdb, cfg); err != nil {
		return nil, usageError{err}
	}
	// The handlers sit behind a switch that a reload swaps; the
	// middleware, before it, swaps its own rules.
	handlers := func(cfg *rules.Config, hs *handler.Config) (*asynq.ServeMux, error) {
		mux := asynq.NewServeMux()
		if err := hs.Register(mux, handler.Options{Rules: cfg, Redis: rdb, Getenv: getenv, Logger: log, Metrics: hmetrics,
			SetCost: worker.SetCost, SetCosts: worker.SetCosts}); err != nil {
			return nil, err
		}
		if a.demo != nil {
			a.demo.register(mux, hs)
		}
		return mux, nil
	}
	mux, err := handlers(cfg, hs)
	if err != nil {
		return nil, usageError{err}
	}
	a.status = newStatus(cfg, hs, metrics.Activity(), hmetrics.LearnedRate)
	a.status.quotas = a.quotas
	a.reloader = &reloader{path: o.config, log: log, getenv: getenv, mw: a.mw, handlers: &handlerSwitch{}, build: handlers, cfg: cfg, status: a.status, quotas: a.quotas}
	a.reloader.handlers.h.Store(mux)
	return a, nil
}

// close ends what build started: the middleware's wake-up loop, and the
// limiters that read the quotas.
func (a *app) close() {
	a.mw.Close()
	a.quotas.Close()
}

// concurrency is the number of tasks processed at once.
func concurrency(o options) int {
	if o.concurrency == 0 {
		return runtime.NumCPU() // asynq's default
	}
	return o.concurrency
}
