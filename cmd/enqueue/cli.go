package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// defaultRedisURL is used when neither --redis nor REDIS_URL is set.
const defaultRedisURL = "redis://127.0.0.1:6379/0"

const usage = `usage:
  enqueue batch --type T --count N [--payload JSON | --payloads FILE.jsonl] [--queue Q]
                [--pace (--rule-config rules.yaml [--rule NAME] | --rule NAME --rate 20/s [--burst 1] (--subject S | --subject-field F))
                        [--max-ahead 24h]]
                [--redis URL]
  enqueue schedule --config schedules.yaml [--run-for 1h] [--redis URL]

Redis: --redis, else $REDIS_URL, else ` + defaultRedisURL + `.
Run "enqueue batch -h" or "enqueue schedule -h" for every flag; see cmd/enqueue/README.md.
`

const redisHelp = "Redis URL: redis://[user:password@]host:port[/db], rediss:// (TLS), redis-cluster://host:port,host:port\nor redis-sentinel://host:port,host:port/master; default $REDIS_URL, else " + defaultRedisURL

// Exit codes, as cmd/worker's.
const (
	exitOK    = 0
	exitError = 1 // the work failed: Redis does not answer, an enqueue failed
	exitUsage = 2 // bad flags or files, a malformed --redis, a batch refused as given
)

// defaultMaxAhead is --max-ahead's default: a paced batch that would book
// its last slot further ahead than a day is refused unless allowed.
const defaultMaxAhead = 24 * time.Hour

// usageError is a mistake in the flags or files: exit 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// errFlagParse stands for an error the flag package has already printed.
var errFlagParse = errors.New("bad flags")

// exitCode prints err, if any, after the command's name and returns the
// exit status for it: 2 for a usageError, else 1.
func exitCode(w io.Writer, cmd string, err error) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	var ue usageError
	isUsage := errors.As(err, &ue)
	if isUsage && ue.err == errFlagParse {
		return exitUsage // the flag package has printed the message and usage
	}
	fail(w, cmd, err)
	if isUsage {
		return exitUsage
	}
	return exitError
}

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
		return exitCode(stderr, "enqueue batch", runBatch(ctx, args[1:], stdout, stderr, getenv, log))
	case "schedule":
		return exitCode(stderr, "enqueue schedule", runSchedule(ctx, args[1:], stderr, getenv, log))
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return exitOK
	}
	fmt.Fprintf(stderr, "enqueue: unknown command %q\n\n%s", args[0], usage)
	return exitUsage
}

// redisConn is the Redis named by --redis or REDIS_URL, opened by
// redisurl.Open as cmd/worker opens it (one server, TLS, Cluster or
// Sentinel) but not yet asked anything.
type redisConn struct {
	rdb      redis.UniversalClient
	raw      string
	redacted string // for logs and errors: without password
}

// openRedis opens the Redis of --redis (flagURL), else REDIS_URL, else the
// default. A URL that does not parse is a usage error; nothing is dialled.
func openRedis(flagURL string, getenv func(string) string) (*redisConn, error) {
	raw := cmp.Or(flagURL, getenv("REDIS_URL"), defaultRedisURL)
	rdb, err := redisurl.Open(raw)
	if err != nil {
		return nil, usageError{err}
	}
	return &redisConn{rdb: rdb, raw: raw, redacted: redisurl.Redact(raw)}, nil
}

// ping checks that Redis answers, within 5 s: a runtime error (exit 1)
// that says whether it refused the password or did not answer.
func (c *redisConn) ping(ctx context.Context, log *slog.Logger) error {
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := redisurl.Ping(pctx, c.rdb, c.raw); err != nil {
		return err
	}
	log.Info("enqueue: connected to Redis", "redis", c.redacted)
	return nil
}

// batchFlags are the flags of enqueue batch.
type batchFlags struct {
	typ, payload, payloads, queue string
	count, maxRetry               int
	timeout                       time.Duration
	pace                          bool
	ruleConfig, rule              string
	rate, algorithm, prefix       string
	burst, wakeupShards           int
	subject, subjectField         string
	keep, lead, retention         time.Duration
	maxAhead                      time.Duration
	redis                         string
}

// flagSet registers the flags of enqueue batch into f.
func (f *batchFlags) flagSet(stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("enqueue batch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.typ, "type", "", "task type (required)")
	fs.Var(&intFlag{p: &f.count, min: 1, max: enqueue.MaxCount}, "count", fmt.Sprintf("number of tasks, 1 to %d; with --payloads, default one per line", enqueue.MaxCount))
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
	f.burst = 1
	fs.Var(&intFlag{p: &f.burst, min: 1, max: throttle.MaxPermits}, "burst", "inline rule: burst, the most tasks the rule admits at one instant (default 1)")
	fs.StringVar(&f.algorithm, "algorithm", "gcra", "inline rule: "+rules.AlgorithmNames(rules.PaceAlgorithms()))
	fs.StringVar(&f.prefix, "prefix", throttle.DefaultPrefix, "inline rule: the workers' key prefix")
	fs.StringVar(&f.subject, "subject", "", "inline rule: the workers' fixed subject")
	fs.StringVar(&f.subjectField, "subject-field", "", "inline rule: the payload field the workers take the subject from")
	fs.DurationVar(&f.lead, "lead", 0, "for workers without wake-ups only: schedule each task this long before its slot, in whole seconds, so that it\nreaches a worker early and waits there for the slot (default 0: the workers wake each task just before its slot)")
	f.wakeupShards = admission.DefaultWakeupShards
	fs.Var(&intFlag{p: &f.wakeupShards, min: 1, max: 64}, "wakeup-shards", "the workers' --wakeup-shards: the number of keys of their wake-up ledger (the same, or fewer)")
	fs.DurationVar(&f.maxAhead, "max-ahead", defaultMaxAhead, "refuse a paced batch whose last slot would be booked further ahead than this; raise it to book further")
	fs.DurationVar(&f.keep, "keep", 0, "how long a paced task's receipt outlives its slot (default 24h); a task run later is charged again")
	fs.StringVar(&f.redis, "redis", "", redisHelp)
	return fs
}

func runBatch(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string, log *slog.Logger) error {
	var f batchFlags
	fs := f.flagSet(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{errFlagParse}
	}
	batch, spec, err := f.batch(fs)
	if err != nil {
		return usageError{err}
	}
	conn, err := openRedis(f.redis, getenv)
	if err != nil {
		return err
	}
	defer conn.rdb.Close()
	if spec != nil {
		if batch.Pacer, err = spec.Pacer(conn.rdb, batch.Type, throttle.Options{Logger: log}); err != nil {
			return usageError{err}
		}
		batch.MaxAhead = f.maxAhead
	}
	// Every task is checked before Redis is asked anything, so that a
	// bad line is a usage error even with Redis down.
	if err := batch.Validate(); err != nil {
		return usageError{err}
	}
	if err := conn.ping(ctx, log); err != nil {
		return err
	}
	client := asynq.NewClientFromRedisClient(conn.rdb)
	defer client.Close()

	prog := newProgress(stderr, isTerminal(stderr), log)
	batch.OnEnqueued = prog.update
	batch.OnPlan = func(p enqueue.Plan) {
		if p.Paced {
			fmt.Fprintf(stderr, "enqueue batch: %s\n", p.Describe())
		}
	}
	start := time.Now()
	res, err := batch.Run(ctx, client)
	prog.finish()
	var ahead *enqueue.AheadError
	switch {
	case errors.As(err, &ahead):
		return usageError{fmt.Errorf("%s, more than --max-ahead %v; split the batch, or raise --max-ahead to book that far ahead (nothing was enqueued)",
			ahead.Plan.Describe(), f.maxAhead)}
	case err != nil:
		return fmt.Errorf("%w (%d enqueued before that)", err, res.Enqueued)
	}
	if batch.Pacer != nil {
		fmt.Fprintf(stdout, "enqueued %d %s tasks in %v, paced: the last is due at %s (in %v)\n", res.Enqueued, batch.Type,
			time.Since(start).Round(time.Millisecond), res.LastDue.Format(time.RFC3339), time.Until(res.LastDue).Round(time.Millisecond))
	} else {
		fmt.Fprintf(stdout, "enqueued %d %s tasks in %v\n", res.Enqueued, batch.Type, time.Since(start).Round(time.Millisecond))
	}
	return nil
}

// batch checks the flags and builds the batch, and the pace spec if paced.
func (f *batchFlags) batch(fs *flag.FlagSet) (*enqueue.Batch, *enqueue.PaceSpec, error) {
	if fs.NArg() > 0 {
		return nil, nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	b, err := f.tasks()
	if err != nil {
		return nil, nil, err
	}
	if b.Options, err = f.options(set); err != nil {
		return nil, nil, err
	}
	spec, err := f.paceSpec(set)
	if err != nil {
		return nil, nil, err
	}
	return b, spec, nil
}

// tasks builds the batch's type, count and payloads, reading --payloads.
func (f *batchFlags) tasks() (*enqueue.Batch, error) {
	b := &enqueue.Batch{Type: f.typ, Count: f.count}
	switch {
	case f.typ == "":
		return nil, errors.New("--type is required")
	case f.payload != "" && f.payloads != "":
		return nil, errors.New("--payload and --payloads cannot be combined")
	case f.count == 0 && f.payloads == "":
		return nil, errors.New("--count is required (or --payloads, one task per line)")
	}
	if f.payload != "" {
		if !json.Valid([]byte(f.payload)) {
			return nil, errors.New("--payload is not valid JSON")
		}
		b.Payloads = [][]byte{[]byte(f.payload)}
	}
	if f.payloads != "" {
		p, err := enqueue.ReadPayloads(f.payloads)
		if err != nil {
			return nil, fmt.Errorf("--payloads: %w", err)
		}
		if len(p.Payloads) == 0 {
			return nil, fmt.Errorf("--payloads: %s has no payload lines", f.payloads)
		}
		if f.count > len(p.Payloads) {
			return nil, fmt.Errorf("--count %d is more than the %d payloads in %s", f.count, len(p.Payloads), f.payloads)
		}
		b.Payloads, b.Where = p.Payloads, p.Where
		if len(p.Payloads) == 1 && f.count == 0 {
			b.Count = 1
		}
	}
	return b, nil
}

// options checks the flags that become asynq options, and --keep and
// --max-ahead, and returns the options.
func (f *batchFlags) options(set map[string]bool) ([]asynq.Option, error) {
	switch {
	case set["max-retry"] && f.maxRetry < 0:
		return nil, fmt.Errorf("--max-retry %d must be 0 or more; leave it out for asynq's default (25)", f.maxRetry)
	case set["timeout"] && f.timeout <= 0:
		return nil, fmt.Errorf("--timeout %v must be positive; leave it out for asynq's default", f.timeout)
	case set["retention"] && f.retention <= 0:
		return nil, fmt.Errorf("--retention %v must be positive; leave it out to keep no completed task", f.retention)
	case set["keep"] && f.keep <= 0:
		return nil, fmt.Errorf("--keep %v must be positive; leave it out for the default (24h)", f.keep)
	case f.maxAhead <= 0:
		return nil, fmt.Errorf("--max-ahead %v must be positive; leave it out for the default (%v)", f.maxAhead, defaultMaxAhead)
	}
	var opts []asynq.Option
	if f.queue != "" {
		opts = append(opts, asynq.Queue(f.queue))
	}
	if f.maxRetry >= 0 {
		opts = append(opts, asynq.MaxRetry(f.maxRetry))
	}
	if f.timeout > 0 {
		opts = append(opts, asynq.Timeout(f.timeout))
	}
	if f.retention > 0 {
		opts = append(opts, asynq.Retention(f.retention))
	}
	return opts, nil
}

// paceSpec checks the pacing flags and returns the pace spec, or nil for
// an unpaced batch.
func (f *batchFlags) paceSpec(set map[string]bool) (*enqueue.PaceSpec, error) {
	inline := []string{"rate", "burst", "algorithm", "prefix", "subject", "subject-field"}
	if !f.pace {
		for _, name := range append(inline, "rule-config", "rule", "keep", "lead", "max-ahead", "wakeup-shards") {
			if set[name] {
				return nil, fmt.Errorf("--%s paces the batch: add --pace", name)
			}
		}
		return nil, nil
	}
	if f.lead < 0 || f.lead > time.Minute {
		return nil, fmt.Errorf("--lead %v must be between 0 and 1m", f.lead)
	}
	spec := &enqueue.PaceSpec{Rule: f.rule, Keep: f.keep, Lead: f.lead, WakeupShards: f.wakeupShards}
	switch {
	case f.ruleConfig != "" && f.rate != "":
		return nil, errors.New("--rule-config and --rate cannot be combined: pace under the workers' rules file, or spell the rule out")
	case f.ruleConfig != "":
		for _, name := range inline {
			if set[name] {
				return nil, fmt.Errorf("--%s comes from --rule-config; remove it", name)
			}
		}
		cfg, err := rules.Load(f.ruleConfig)
		if err != nil {
			return nil, err
		}
		spec.Rules = cfg
	case f.rate != "":
		if f.rule == "" {
			return nil, errors.New("--rate needs --rule: the name the workers' rules file gives the rule (the last part of its Redis key)")
		}
		lim, err := enqueue.ParseRate(f.rate, f.burst)
		if err != nil {
			return nil, fmt.Errorf("--rate: %w", err)
		}
		algo, err := rules.ParseAlgorithm(f.algorithm)
		if err != nil {
			return nil, fmt.Errorf("--algorithm: %w", err)
		}
		if (f.subject == "") == (f.subjectField == "") {
			return nil, errors.New("--rate needs exactly one of --subject and --subject-field, as the workers' rule has")
		}
		spec.Limit, spec.Algorithm, spec.Prefix = lim, algo, f.prefix
		spec.Subject = rules.SubjectConfig{Fixed: f.subject, PayloadField: f.subjectField}
	default:
		return nil, errors.New("--pace needs the workers' rule: --rule-config rules.yaml, or --rule, --rate and --subject/--subject-field")
	}
	return spec, nil
}

func runSchedule(ctx context.Context, args []string, stderr io.Writer, getenv func(string) string, log *slog.Logger) error {
	fs := flag.NewFlagSet("enqueue schedule", flag.ContinueOnError)
	fs.SetOutput(stderr)
	config := fs.String("config", "", "schedules file (required; see README.md)")
	runFor := fs.Duration("run-for", 0, "stop after this long and exit 1 if any firing failed (default: run until interrupted)")
	metricsAddr := fs.String("metrics-addr", "", "serve Prometheus metrics (firings by outcome) at http://<addr>/metrics, such as :9091")
	redisURL := fs.String("redis", "", redisHelp)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{errFlagParse}
	}
	switch {
	case fs.NArg() > 0:
		return usageError{fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	case *config == "":
		return usageError{errors.New("--config is required")}
	case *runFor < 0:
		return usageError{errors.New("--run-for must not be negative")}
	}
	s, err := enqueue.LoadSchedules(*config)
	if err != nil {
		return usageError{err}
	}
	conn, err := openRedis(*redisURL, getenv)
	if err != nil {
		return err
	}
	defer conn.rdb.Close()
	client := asynq.NewClientFromRedisClient(conn.rdb)
	defer client.Close()
	firings := newFiringMetrics()
	// NewScheduler builds every limiter and checks every task without
	// asking Redis anything: a mistake is a usage error even with Redis
	// down.
	sch, err := enqueue.NewScheduler(s, enqueue.SchedulerOptions{Redis: conn.rdb, Client: client, Logger: log, OnBatch: firings.onBatch})
	if err != nil {
		return usageError{err}
	}
	if err := conn.ping(ctx, log); err != nil {
		return err
	}
	if *metricsAddr != "" {
		stop, err := firings.serve(*metricsAddr, log)
		if err != nil {
			return usageError{err}
		}
		defer stop()
	}
	if *runFor > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *runFor)
		defer cancel()
	}
	log.Info("enqueue: running schedules", "file", *config, "schedules", len(s.Schedules))
	if err := sch.Run(ctx); err != nil {
		return err
	}
	log.Info("enqueue: stopped", "firings", firings.total(), "failed", firings.failed())
	if n := firings.failed(); n > 0 && *runFor > 0 {
		return fmt.Errorf("%d of %d firings failed (see the log)", n, firings.total())
	}
	return nil
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

// intFlag is a whole-number flag from min to max whose errors say which
// bound was missed: "must be at least 1", "is too large: at most 10000000".
type intFlag struct {
	p        *int
	min, max int
}

func (f *intFlag) String() string {
	if f.p == nil {
		return ""
	}
	return strconv.Itoa(*f.p)
}

func (f *intFlag) Set(s string) error {
	v, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	switch {
	case errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(strings.TrimSpace(s), "-"), err == nil && v > int64(f.max):
		return fmt.Errorf("is too large: at most %d", f.max)
	case errors.Is(err, strconv.ErrRange), err == nil && v < int64(f.min):
		return fmt.Errorf("must be at least %d", f.min)
	case err != nil:
		return fmt.Errorf("must be a whole number from %d to %d", f.min, f.max)
	}
	*f.p = int(v)
	return nil
}
