package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// exampleRules are the rules used when no --config is given.
//
//go:embed rules.example.yaml
var exampleRules []byte

// pingTimeout bounds the check that Redis answers at start.
const pingTimeout = 5 * time.Second

// run runs the worker until ctx ends or signals brings SIGINT or SIGTERM,
// then shuts it down gracefully (a second such signal stops it at once);
// SIGHUP on signals reloads the rules file. signals may be nil. Mistakes
// in the flags, the rules file and the environment are usageErrors, found
// before anything connects or starts.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer, signals <-chan os.Signal) (err error) {
	o, err := parseFlags(args, getenv, stderr)
	if err != nil {
		var ue usageError
		if errors.Is(err, flag.ErrHelp) || errors.As(err, &ue) {
			return err
		}
		return usageError{err}
	}
	log := newLogger(stderr, o.logLevel, o.logJSON)
	cfg, handlers, err := validate(o, getenv)
	if err != nil {
		return err
	}
	if o.check {
		check(stdout, cfg, handlers)
		return nil
	}

	if processLogs != nil {
		processLogs(log)
	}
	ctx, sig, stopSignals := watchSignals(ctx, signals, log)
	defer stopSignals()
	rdb, closeRedis, err := connect(ctx, log, o)
	if err != nil {
		return err
	}
	defer func() {
		// Stopped at once, asynq is still shutting down on rdb, and would
		// panic on a closed client; the process exits now anyway.
		if !errors.Is(err, errStoppedAtOnce) {
			closeRedis()
		}
	}()
	if o.config == "" {
		log.Warn("worker: no --config or JOBTHROTTLE_CONFIG: using the built-in demo rules", "rules", ruleNames(cfg))
	} else {
		log.Info("worker: rules loaded", "file", o.config, "rules", ruleNames(cfg), "handlers", handlerNames(handlers))
	}
	a, err := build(o, cfg, handlers, rdb, getenv, log)
	if err != nil {
		return err
	}
	defer a.close()
	return serve(ctx, o, a, rdb, sig, log)
}

// serve runs a's handlers on an asynq server until ctx ends, then shuts
// it down gracefully, unless sig says to stop at once.
func serve(ctx context.Context, o options, a *app, rdb redis.UniversalClient, sig *signalled, log *slog.Logger) error {
	if a.demo != nil {
		if err := a.demo.listen(); err != nil {
			return err
		}
		defer a.demo.close()
	}
	if o.metricsAddr != "" {
		stop, err := serveMetrics(o.metricsAddr, a.reg, a.ready, a.status, log)
		if err != nil {
			return err
		}
		defer stop()
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency:     o.concurrency,
		Queues:          o.queues,
		ShutdownTimeout: o.shutdownTimeout,
		Logger:          worker.AsynqLogger(log),
		LogLevel:        asynqLevel(o.logLevel),
	}))
	if err := srv.Start(a.mw.Wrap(a.status.observe(a.reloader.handlers))); err != nil {
		return fmt.Errorf("starting the asynq server: %w", err)
	}
	log.Info("worker: processing", "queues", o.queues, "concurrency", concurrency(o))

	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-sig.hup:
			a.reloader.reload()
		}
	}
	log.Info("worker: shutting down: no new tasks; waiting tasks go back for other workers; a second SIGTERM or SIGINT stops at once", "shutdown_timeout", o.shutdownTimeout)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		srv.Stop()
		a.mw.Drain()
		srv.Shutdown()
	}()
	select {
	case <-stopped:
	case <-sig.now:
		return errStoppedAtOnce
	}
	log.Info("worker: stopped")
	return nil
}

// loadRules reads the rules file at path (the built-in demo rules if
// path is ""): the limits and the handlers.
func loadRules(path string) (*rules.Config, *handler.Config, error) {
	name, data := "rules.example.yaml (built in)", exampleRules
	if path != "" {
		var err error
		if data, err = os.ReadFile(path); err != nil {
			return nil, nil, usageError{fmt.Errorf("reading the rules file: %w", err)}
		}
		name = path
	}
	cfg, err := rules.Parse(name, data)
	if err != nil {
		return nil, nil, usageError{err}
	}
	handlers, err := handler.FromRules(cfg)
	if err != nil {
		return nil, nil, usageError{err}
	}
	return cfg, handlers, nil
}

// connect opens the Redis of o.redisURL, or starts an in-memory one (and
// says so in the first log line), and checks that it answers.
func connect(ctx context.Context, log *slog.Logger, o options) (redis.UniversalClient, func(), error) {
	var rdb redis.UniversalClient
	closeAll := func() {}
	redacted := ""
	if o.redisURL == "" {
		dev, err := devredis.Start(o.embeddedAddr)
		if err != nil {
			return nil, nil, err
		}
		log.Warn("worker: no --redis or REDIS_URL: started an in-memory Redis (miniredis) for this process; its data is lost on exit. Other processes can use it",
			"url", dev.URL())
		rdb = redis.NewClient(&redis.Options{Addr: dev.Addr()})
		closeAll = func() { _ = rdb.Close(); dev.Close() }
		redacted = dev.URL()
	} else {
		var err error
		if rdb, err = redisurl.Open(o.redisURL); err != nil {
			return nil, nil, usageError{err}
		}
		closeAll = func() { _ = rdb.Close() }
		redacted = redisurl.Redact(o.redisURL)
		log.Info("worker: using Redis", "url", redacted)
	}
	pctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		closeAll()
		return nil, nil, redisFailure("Redis at "+redacted, err)
	}
	return rdb, closeAll, nil
}

func ruleNames(c *rules.Config) []string {
	var names []string
	for _, r := range c.Rules {
		names = append(names, r.Name)
	}
	return names
}

func handlerNames(c *handler.Config) []string {
	var names []string
	for _, h := range c.Handlers {
		names = append(names, h.Task)
	}
	return names
}
