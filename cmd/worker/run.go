package main

import (
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// exampleRules are the rules used when no --config is given.
//
//go:embed rules.example.yaml
var exampleRules []byte

// pingTimeout bounds the check that Redis answers at start.
const pingTimeout = 5 * time.Second

// options are the command line settings.
type options struct {
	redisURL        string
	config          string
	concurrency     int
	queues          map[string]int
	metricsAddr     string
	embeddedAddr    string
	shutdownTimeout time.Duration
	demoAPIRate     int
	logLevel        slog.Level
	logJSON         bool
	check           bool
}

// parseFlags reads the flags, falling back to the environment for the
// Redis URL, the rules file and the metrics address. Environment values
// are not flag defaults, so -help never prints a password.
func parseFlags(args []string, getenv func(string) string, out io.Writer) (options, error) {
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.SetOutput(out)
	var o options
	var queues, level, format string
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL, else $REDIS_URL: redis://[user:password@]host:port[/db], rediss:// (TLS),\nredis-cluster://host:port,host:port or redis-sentinel://host:port,host:port/master;\nif neither is set, an in-memory Redis is started on loopback")
	fs.StringVar(&o.config, "config", "", "rules file (YAML, see worker/README.md), else $JOBTHROTTLE_CONFIG; if neither, built-in demo rules.\nRead again on SIGHUP: new limits apply to new bookings, a file that fails to load changes nothing")
	fs.IntVar(&o.concurrency, "concurrency", 0, "tasks processed at once (0: the number of CPUs)")
	fs.StringVar(&queues, "queues", "default=1", "queues to process and their priorities, such as critical=6,default=3")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://<addr>/metrics, with /healthz and /readyz beside, such as :9090, else $JOBTHROTTLE_METRICS_ADDR")
	fs.StringVar(&o.embeddedAddr, "embedded-redis-addr", "127.0.0.1:0", "where the in-memory Redis listens when no Redis URL is given")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 10*time.Second, "on SIGTERM, how long running tasks may finish before they are put back in their queues")
	fs.IntVar(&o.demoAPIRate, "demo-api-rate", 5, "requests per second that demo:api tasks send to the demo third-party API, across all workers")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&format, "log-format", "text", "text or json")
	fs.BoolVar(&o.check, "check", false, "validate the rules file, print its rules and handlers as understood, and exit (0 if valid, 2 if not); connects to nothing")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, err
		}
		return o, usageError{errFlagParse}
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q: every setting is a flag (see -help)", fs.Arg(0))
	}
	for _, env := range []struct {
		v    *string
		name string
	}{{&o.redisURL, "REDIS_URL"}, {&o.config, "JOBTHROTTLE_CONFIG"}, {&o.metricsAddr, "JOBTHROTTLE_METRICS_ADDR"}} {
		if *env.v == "" {
			*env.v = getenv(env.name)
		}
	}
	var err error
	if o.queues, err = parseQueues(queues); err != nil {
		return o, err
	}
	if err := o.logLevel.UnmarshalText([]byte(level)); err != nil {
		return o, fmt.Errorf("-log-level %q: use debug, info, warn or error", level)
	}
	switch format {
	case "text", "json":
		o.logJSON = format == "json"
	default:
		return o, fmt.Errorf("-log-format %q: use text or json", format)
	}
	switch {
	case o.concurrency < 0:
		return o, fmt.Errorf("-concurrency %d: must be 0 (the number of CPUs) or more", o.concurrency)
	case o.shutdownTimeout <= 0:
		return o, fmt.Errorf("-shutdown-timeout %v: must be positive", o.shutdownTimeout)
	case o.demoAPIRate < 1:
		return o, fmt.Errorf("-demo-api-rate %d: must be at least 1", o.demoAPIRate)
	}
	return o, nil
}

// parseQueues reads "critical=6,default=3" (a queue without "=n" has
// priority 1).
func parseQueues(s string) (map[string]int, error) {
	queues := map[string]int{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, prio, hasPrio := strings.Cut(part, "=")
		name = strings.TrimSpace(name)
		p := 1
		if hasPrio {
			var err error
			if p, err = strconv.Atoi(strings.TrimSpace(prio)); err != nil || p < 1 {
				return nil, fmt.Errorf("-queues: %q: the priority must be a whole number of at least 1, as in critical=6,default=3", part)
			}
		}
		if name == "" {
			return nil, fmt.Errorf("-queues: %q: missing queue name, as in critical=6,default=3", part)
		}
		if _, dup := queues[name]; dup {
			return nil, fmt.Errorf("-queues: queue %q is listed twice", name)
		}
		queues[name] = p
	}
	if len(queues) == 0 {
		return nil, errors.New("-queues: no queue given; use, for example, default=1")
	}
	return queues, nil
}

// run runs the worker until ctx ends, then shuts it down gracefully; it
// reloads the rules file each time reload delivers (SIGHUP; nil: never).
// Mistakes in the flags and the rules file are usageErrors.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer, reload <-chan os.Signal) error {
	o, err := parseFlags(args, getenv, stderr)
	if err != nil {
		var ue usageError
		if errors.Is(err, flag.ErrHelp) || errors.As(err, &ue) {
			return err
		}
		return usageError{err}
	}
	hopts := &slog.HandlerOptions{Level: o.logLevel}
	var log *slog.Logger
	if o.logJSON {
		log = slog.New(slog.NewJSONHandler(stderr, hopts))
	} else {
		log = slog.New(slog.NewTextHandler(stderr, hopts))
	}

	if processLogs != nil {
		processLogs(log)
	}

	// The rules first: a malformed file fails before anything starts.
	cfg, handlers, err := loadRules(o.config)
	if err != nil {
		return err
	}
	if o.check {
		check(stdout, cfg, handlers)
		return nil
	}

	rdb, closeRedis, err := connect(ctx, log, o)
	if err != nil {
		return err
	}
	defer closeRedis()
	if o.config == "" {
		log.Warn("worker: no --config or JOBTHROTTLE_CONFIG: using the built-in demo rules", "rules", ruleNames(cfg))
	} else {
		log.Info("worker: rules loaded", "file", o.config, "rules", ruleNames(cfg), "handlers", handlerNames(handlers))
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		return err
	}
	concurrency := o.concurrency
	if concurrency == 0 {
		concurrency = runtime.NumCPU() // asynq's default
	}
	// Half the slots at most wait for turns, so the other half always
	// serves tasks that can run, however many subjects are over their limits.
	mw, err := worker.FromRules(cfg, rdb, worker.Options{Logger: log, Metrics: metrics, Asynq: rdb, MaxWaiting: max(concurrency/2, 1)})
	if err != nil {
		return err
	}
	demo, err := startDemo(rdb, cfg.Prefix, o.demoAPIRate, log)
	if err != nil {
		return err
	}
	defer demo.close()

	if o.metricsAddr != "" {
		ready, err := readiness(rdb, cfg)
		if err != nil {
			return err
		}
		stop, err := serveMetrics(o.metricsAddr, reg, ready, log)
		if err != nil {
			return err
		}
		defer stop()
	}

	// The handlers sit behind a switch that a reload swaps; the
	// middleware, before it, swaps its own rules.
	build := func(cfg *rules.Config, handlers *handler.Config) (*asynq.ServeMux, error) {
		mux := asynq.NewServeMux()
		if err := handlers.Register(mux, handler.Options{Rules: cfg, Redis: rdb, Getenv: getenv, Logger: log}); err != nil {
			return nil, err
		}
		demo.register(mux, handlers)
		return mux, nil
	}
	mux, err := build(cfg, handlers)
	if err != nil {
		return err
	}
	r := &reloader{path: o.config, log: log, mw: mw, handlers: &handlerSwitch{}, build: build, cfg: cfg}
	r.handlers.h.Store(mux)
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency:     o.concurrency,
		Queues:          o.queues,
		ShutdownTimeout: o.shutdownTimeout,
		Logger:          worker.AsynqLogger(log),
		LogLevel:        asynqLevel(o.logLevel),
	}))
	if err := srv.Start(mw.Wrap(r.handlers)); err != nil {
		return fmt.Errorf("starting the asynq server: %w", err)
	}
	log.Info("worker: processing", "queues", o.queues, "concurrency", concurrency)

	for ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-reload:
			r.reload()
		}
	}
	log.Info("worker: shutting down: no new tasks; waiting tasks go back for other workers", "shutdown_timeout", o.shutdownTimeout)
	srv.Stop()
	mw.Drain()
	srv.Shutdown()
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
	handlers, err := handler.ParseConfig(name, data)
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
		return nil, nil, fmt.Errorf("Redis at %s does not answer: %v", redacted, err)
	}
	return rdb, closeAll, nil
}

// serveMetrics serves /metrics, /healthz (the process is up) and /readyz
// (ready answers nil: Redis answers and the throttle scripts run) on addr
// until stop is called.
func serveMetrics(addr string, reg *prometheus.Registry, ready func(context.Context) error, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, usageError{fmt.Errorf("-metrics-addr: %w", err)}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
		defer cancel()
		if err := ready(ctx); err != nil {
			// The error names no password: connect() checked the URL.
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("worker: metrics server failed", "error", err)
		}
	}()
	base := "http://" + ln.Addr().String()
	log.Info("worker: serving metrics", "url", base+"/metrics", "healthz", base+"/healthz", "readyz", base+"/readyz")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

// readyTimeout bounds the checks of one /readyz request.
const readyTimeout = 2 * time.Second

// readiness returns the /readyz check: Redis answers PING, and a throttle
// script runs under the rules' prefix (go-redis loads it if Redis has
// lost it, say after a restart).
func readiness(rdb redis.UniversalClient, cfg *rules.Config) (func(context.Context) error, error) {
	lim, err := cfg.Limiter(rdb, cfg.Rules[0].Name, throttle.Options{})
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error {
		if err := rdb.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("Redis does not answer: %v", err)
		}
		if _, err := lim.PauseFor(ctx, "readyz", 0); err != nil {
			return fmt.Errorf("the throttle scripts do not run: %v", err)
		}
		return nil
	}, nil
}

func ruleNames(c *rules.Config) []string {
	var names []string
	for _, r := range c.Rules {
		names = append(names, r.Name)
	}
	return names
}

// processLogs, if set, routes the process-wide loggers to log: main sets
// it so that go-redis's own lines (dial retries, pool notices) go to the
// same logger and --log-format json gives only JSON. go-redis has one
// logger per process, so tests, which call run in parallel, leave it nil.
var processLogs func(log *slog.Logger)

// redisLogger sends go-redis's own log lines to slog, at warn level:
// they are about connections failing and retried.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, fmt.Sprintf(format, v...), "component", "go-redis")
}

func handlerNames(c *handler.Config) []string {
	var names []string
	for _, h := range c.Handlers {
		names = append(names, h.Task)
	}
	return names
}

// asynqLevel is the asynq log level matching a slog level.
func asynqLevel(l slog.Level) asynq.LogLevel {
	switch {
	case l <= slog.LevelDebug:
		return asynq.DebugLevel
	case l <= slog.LevelInfo:
		return asynq.InfoLevel
	case l <= slog.LevelWarn:
		return asynq.WarnLevel
	default:
		return asynq.ErrorLevel
	}
}
