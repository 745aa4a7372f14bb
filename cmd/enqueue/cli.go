package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// defaultRedisURL is used when neither --redis nor REDIS_URL is set.
const defaultRedisURL = "redis://127.0.0.1:6379/0"

const usage = `usage:
  enqueue batch --type T --count N [--payload JSON | --payloads FILE.jsonl] [--queue Q]
                [--pace (--rule-config rules.yaml [--rule NAME] | --rule NAME --rate 20/s [--burst 1] (--subject S | --subject-field F))]
                [--redis URL]
  enqueue schedule --config schedules.yaml [--run-for 1h] [--redis URL]

Redis: --redis, else $REDIS_URL, else ` + defaultRedisURL + `.
Run "enqueue batch -h" or "enqueue schedule -h" for every flag; see cmd/enqueue/README.md.
`

const redisHelp = "Redis URL: redis://[user:password@]host:port[/db], rediss:// (TLS), redis-cluster://host:port,host:port\nor redis-sentinel://host:port,host:port/master; default $REDIS_URL, else " + defaultRedisURL

// Exit codes.
const (
	exitOK    = 0
	exitError = 1 // the work failed
	exitUsage = 2 // bad flags or files
)

// run is the whole command, minus the process: args exclude the program
// name; getenv reads the environment.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	redis.SetLogger(redisLogger{log})
	switch args[0] {
	case "batch":
		return runBatch(ctx, args[1:], stdout, stderr, getenv, log)
	case "schedule":
		return runSchedule(ctx, args[1:], stderr, getenv, log)
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	}
	fmt.Fprintf(stderr, "enqueue: unknown command %q\n\n%s", args[0], usage)
	return exitUsage
}

// connect opens the Redis named by --redis or REDIS_URL, as cmd/worker
// does (redisurl.Open: one server, TLS, Cluster or Sentinel), and
// checks that it answers. Logs and errors show the URL without password.
func connect(ctx context.Context, flagURL string, getenv func(string) string, log *slog.Logger) (redis.UniversalClient, error) {
	raw := flagURL
	if raw == "" {
		raw = getenv("REDIS_URL")
	}
	if raw == "" {
		raw = defaultRedisURL
	}
	rdb, err := redisurl.Open(raw)
	if err != nil {
		return nil, err
	}
	redacted := redisurl.Redact(raw)
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		_ = rdb.Close()
		return nil, fmt.Errorf("redis %s does not answer: %w", redacted, err)
	}
	log.Info("enqueue: connected to Redis", "redis", redacted)
	return rdb, nil
}

// batchFlags are the flags of enqueue batch.
type batchFlags struct {
	typ, payload, payloads, queue string
	count, maxRetry               int
	timeout                       time.Duration
	pace                          bool
	ruleConfig, rule              string
	rate, algorithm, prefix       string
	burst                         int
	subject, subjectField         string
	keep, lead, retention         time.Duration
	redis                         string
}

// flagSet registers the flags of enqueue batch into f.
func (f *batchFlags) flagSet(stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("enqueue batch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.typ, "type", "", "task type (required)")
	fs.IntVar(&f.count, "count", 0, "number of tasks; with --payloads, default one per line")
	fs.StringVar(&f.payload, "payload", "", "JSON payload of every task")
	fs.StringVar(&f.payloads, "payloads", "", "file with one JSON payload per line, one task each")
	fs.StringVar(&f.queue, "queue", "", "asynq queue (default asynq's \"default\")")
	fs.IntVar(&f.maxRetry, "max-retry", -1, "asynq MaxRetry of each task, 0 or more (default asynq's, 25)")
	fs.DurationVar(&f.timeout, "timeout", 0, "asynq Timeout of each task, positive (default asynq's)")
	fs.DurationVar(&f.retention, "retention", 0, "asynq Retention: keep each completed task and its result this long, positive (default asynq's: not kept)")
	fs.BoolVar(&f.pace, "pace", false, "book each task's slot in the workers' ledger and schedule it for that slot")
	fs.StringVar(&f.ruleConfig, "rule-config", "", "the workers' rules file; pace under the rule it applies to --type")
	fs.StringVar(&f.rule, "rule", "", "the workers' rule name (with --rule-config: a check; with --rate: required)")
	fs.StringVar(&f.rate, "rate", "", "inline rule instead of --rule-config: count/period such as 20/s, 100/m, 3/500ms; must match the workers' rule")
	fs.IntVar(&f.burst, "burst", 1, "inline rule: burst")
	fs.StringVar(&f.algorithm, "algorithm", "gcra", "inline rule: gcra, token_bucket, fixed_window, sliding_log or sliding_window")
	fs.StringVar(&f.prefix, "prefix", throttle.DefaultPrefix, "inline rule: the workers' key prefix")
	fs.StringVar(&f.subject, "subject", "", "inline rule: the workers' fixed subject")
	fs.StringVar(&f.subjectField, "subject-field", "", "inline rule: the payload field the workers take the subject from")
	fs.DurationVar(&f.lead, "lead", 0, "for workers without wake-ups only: schedule each task this long before its slot, in whole seconds, so that it\nreaches a worker early and waits there for the slot (default 0: the workers wake each task just before its slot)")
	fs.DurationVar(&f.keep, "keep", 0, "how long a paced task's receipt outlives its slot (default 24h); a task run later is charged again")
	fs.StringVar(&f.redis, "redis", "", redisHelp)
	return fs
}

func runBatch(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string, log *slog.Logger) int {
	var f batchFlags
	fs := f.flagSet(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	batch, spec, err := f.batch(fs)
	if err != nil {
		fail(stderr, "enqueue batch", err)
		return exitUsage
	}
	rdb, err := connect(ctx, f.redis, getenv, log)
	if err != nil {
		fail(stderr, "enqueue batch", err)
		return exitError
	}
	defer rdb.Close()
	if spec != nil {
		if batch.Pacer, err = spec.Pacer(rdb, batch.Type, throttle.Options{Logger: log}); err != nil {
			fail(stderr, "enqueue batch", err)
			return exitUsage
		}
	}
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()

	prog := newProgress(stderr, isTerminal(stderr), log)
	batch.OnEnqueued = prog.update
	start := time.Now()
	res, err := batch.Run(ctx, client)
	prog.finish()
	if err != nil {
		fail(stderr, "enqueue batch", fmt.Errorf("%w (%d enqueued before that)", err, res.Enqueued))
		return exitError
	}
	if batch.Pacer != nil {
		fmt.Fprintf(stdout, "enqueued %d %s tasks in %v, paced: the last is due at %s (in %v)\n", res.Enqueued, batch.Type,
			time.Since(start).Round(time.Millisecond), res.LastDue.Format(time.RFC3339), time.Until(res.LastDue).Round(time.Millisecond))
	} else {
		fmt.Fprintf(stdout, "enqueued %d %s tasks in %v\n", res.Enqueued, batch.Type, time.Since(start).Round(time.Millisecond))
	}
	return exitOK
}

// batch checks the flags and builds the batch, and the pace spec if paced.
func (f *batchFlags) batch(fs *flag.FlagSet) (*enqueue.Batch, *enqueue.PaceSpec, error) {
	if fs.NArg() > 0 {
		return nil, nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	b := &enqueue.Batch{Type: f.typ, Count: f.count}
	switch {
	case f.typ == "":
		return nil, nil, errors.New("--type is required")
	case f.payload != "" && f.payloads != "":
		return nil, nil, errors.New("--payload and --payloads cannot be combined")
	case f.count < 0:
		return nil, nil, fmt.Errorf("--count %d must be at least 1", f.count)
	case f.count == 0 && f.payloads == "":
		return nil, nil, errors.New("--count is required (or --payloads, one task per line)")
	}
	if f.payload != "" {
		if !json.Valid([]byte(f.payload)) {
			return nil, nil, errors.New("--payload is not valid JSON")
		}
		b.Payloads = [][]byte{[]byte(f.payload)}
	}
	if f.payloads != "" {
		p, err := enqueue.ReadPayloads(f.payloads)
		if err != nil {
			return nil, nil, fmt.Errorf("--payloads: %w", err)
		}
		if len(p) == 0 {
			return nil, nil, fmt.Errorf("--payloads: %s has no payload lines", f.payloads)
		}
		if f.count > len(p) {
			return nil, nil, fmt.Errorf("--count %d is more than the %d payloads in %s", f.count, len(p), f.payloads)
		}
		b.Payloads = p
		if len(p) == 1 && f.count == 0 {
			b.Count = 1
		}
	}
	if f.queue != "" {
		b.Options = append(b.Options, asynq.Queue(f.queue))
	}
	switch {
	case set["max-retry"] && f.maxRetry < 0:
		return nil, nil, fmt.Errorf("--max-retry %d must be 0 or more; leave it out for asynq's default (25)", f.maxRetry)
	case set["timeout"] && f.timeout <= 0:
		return nil, nil, fmt.Errorf("--timeout %v must be positive; leave it out for asynq's default", f.timeout)
	case set["retention"] && f.retention <= 0:
		return nil, nil, fmt.Errorf("--retention %v must be positive; leave it out to keep no completed task", f.retention)
	case set["keep"] && f.keep <= 0:
		return nil, nil, fmt.Errorf("--keep %v must be positive; leave it out for the default (24h)", f.keep)
	}
	if f.maxRetry >= 0 {
		b.Options = append(b.Options, asynq.MaxRetry(f.maxRetry))
	}
	if f.timeout > 0 {
		b.Options = append(b.Options, asynq.Timeout(f.timeout))
	}
	if f.retention > 0 {
		b.Options = append(b.Options, asynq.Retention(f.retention))
	}
	inline := []string{"rate", "burst", "algorithm", "prefix", "subject", "subject-field"}
	if !f.pace {
		for _, name := range append(inline, "rule-config", "rule", "keep", "lead") {
			if set[name] {
				return nil, nil, fmt.Errorf("--%s paces the batch: add --pace", name)
			}
		}
		return b, nil, nil
	}
	if f.lead < 0 || f.lead > time.Minute {
		return nil, nil, fmt.Errorf("--lead %v must be between 0 and 1m", f.lead)
	}
	spec := &enqueue.PaceSpec{Rule: f.rule, Keep: f.keep, Lead: f.lead}
	switch {
	case f.ruleConfig != "" && f.rate != "":
		return nil, nil, errors.New("--rule-config and --rate cannot be combined: pace under the workers' rules file, or spell the rule out")
	case f.ruleConfig != "":
		for _, name := range inline {
			if set[name] {
				return nil, nil, fmt.Errorf("--%s comes from --rule-config; remove it", name)
			}
		}
		cfg, err := rules.Load(f.ruleConfig)
		if err != nil {
			return nil, nil, err
		}
		spec.Rules = cfg
	case f.rate != "":
		if f.rule == "" {
			return nil, nil, errors.New("--rate needs --rule: the name the workers' rules file gives the rule (the last part of its Redis key)")
		}
		lim, err := enqueue.ParseRate(f.rate, f.burst)
		if err != nil {
			return nil, nil, fmt.Errorf("--rate: %w", err)
		}
		algo, err := rules.ParseAlgorithm(f.algorithm)
		if err != nil {
			return nil, nil, fmt.Errorf("--algorithm: %w", err)
		}
		if (f.subject == "") == (f.subjectField == "") {
			return nil, nil, errors.New("--rate needs exactly one of --subject and --subject-field, as the workers' rule has")
		}
		spec.Limit, spec.Algorithm, spec.Prefix = lim, algo, f.prefix
		spec.Subject = rules.SubjectConfig{Fixed: f.subject, PayloadField: f.subjectField}
	default:
		return nil, nil, errors.New("--pace needs the workers' rule: --rule-config rules.yaml, or --rule, --rate and --subject/--subject-field")
	}
	return b, spec, nil
}

func runSchedule(ctx context.Context, args []string, stderr io.Writer, getenv func(string) string, log *slog.Logger) int {
	fs := flag.NewFlagSet("enqueue schedule", flag.ContinueOnError)
	fs.SetOutput(stderr)
	config := fs.String("config", "", "schedules file (required; see README.md)")
	runFor := fs.Duration("run-for", 0, "stop after this long and exit 1 if any firing failed (default: run until interrupted)")
	metricsAddr := fs.String("metrics-addr", "", "serve Prometheus metrics (firings by outcome) at http://<addr>/metrics, such as :9091")
	redisURL := fs.String("redis", "", redisHelp)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "enqueue schedule: unexpected argument %q\n", fs.Arg(0))
		return exitUsage
	case *config == "":
		fmt.Fprintln(stderr, "enqueue schedule: --config is required")
		return exitUsage
	case *runFor < 0:
		fmt.Fprintln(stderr, "enqueue schedule: --run-for must not be negative")
		return exitUsage
	}
	s, err := enqueue.LoadSchedules(*config)
	if err != nil {
		fail(stderr, "enqueue schedule", err)
		return exitUsage
	}
	rdb, err := connect(ctx, *redisURL, getenv, log)
	if err != nil {
		fail(stderr, "enqueue schedule", err)
		return exitError
	}
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	firings := newFiringMetrics()
	if *metricsAddr != "" {
		stop, err := firings.serve(*metricsAddr, log)
		if err != nil {
			fail(stderr, "enqueue schedule", err)
			return exitUsage
		}
		defer stop()
	}
	sch, err := enqueue.NewScheduler(s, enqueue.SchedulerOptions{Redis: rdb, Client: client, Logger: log, OnBatch: firings.onBatch})
	if err != nil {
		fail(stderr, "enqueue schedule", err)
		return exitUsage
	}
	if *runFor > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *runFor)
		defer cancel()
	}
	log.Info("enqueue: running schedules", "file", *config, "schedules", len(s.Schedules))
	if err := sch.Run(ctx); err != nil {
		fail(stderr, "enqueue schedule", err)
		return exitError
	}
	log.Info("enqueue: stopped", "firings", firings.total(), "failed", firings.failed())
	if n := firings.failed(); n > 0 && *runFor > 0 {
		fmt.Fprintf(stderr, "enqueue schedule: %d of %d firings failed (see the log)\n", n, firings.total())
		return exitError
	}
	return exitOK
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// fail prints err after the command's name, without repeating a package
// prefix.
func fail(w io.Writer, cmd string, err error) {
	msg := err.Error()
	for _, p := range []string{"enqueue: ", "worker: ", "throttle: "} {
		msg = strings.TrimPrefix(msg, p)
	}
	fmt.Fprintf(w, "%s: %s\n", cmd, msg)
}

// redisLogger sends go-redis's own log lines (dial retries and the like)
// to slog at debug level: the command reports what matters itself.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.DebugContext(ctx, "redis: "+fmt.Sprintf(format, v...))
}
