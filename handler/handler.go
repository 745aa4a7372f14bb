// Package handler runs the task types a rules file names in its handlers
// section, so that a worker fleet needs no Go code for its jobs: an http
// handler sends the task's payload to an API, a command handler runs a
// program with the payload on its stdin.
//
//	cfg, err := rules.Load("rules.yaml")             // the limits
//	hs, err := handler.FromRules(cfg)                // what runs each task type, from the same read
//	mux := asynq.NewServeMux()
//	mux.Use(mw.Wrap)                                 // worker.FromRules(cfg, rdb, ...)
//	err = hs.Register(mux, handler.Options{Rules: cfg, Redis: rdb})
//
// Outcomes map to asynq as follows. Success: the output (cut to the
// handler's result_limit) is the task's result. A request the upstream
// rejects (4xx other than 429), an exit code listed in
// no_retry_exit_codes, and a payload the handler cannot use: archived at
// once (the error wraps asynq.SkipRetry). An upstream that asks to slow
// down (429, 503): the rule's subject is paused in Redis for every worker
// and the task is deferred with a *admission.ThrottledError, which
// worker.Configure reschedules without counting a failure. Everything
// else (5xx, timeouts, connection errors, other exit codes): asynq's
// retry with backoff. Their errors end "will retry", or "no retry left:
// archived" for a task on its last try.
//
// Every attempt is counted by outcome and timed (Options.Metrics), and
// every failed one is logged once: at Warn when asynq will retry the
// task, at Error when it will not, with the task's type and ID, the rule
// that limits its type, the HTTP status or the exit code or signal, how
// long it took and whether it will be retried. Deferrals (429, 503) are
// not failures: they count as OutcomeThrottled and log at Info.
//
// An http request carries the task's ID in the Idempotency-Key header
// (HTTPSpec.IdempotencyHeader), the same on every try of one task. On
// Unix, a command runs in a process group of its own under a supervisor process
// (the program's own executable again, started under the name
// "jobthrottle-supervise", which any program importing this package
// recognises before its main runs): at the timeout or when the task's
// context ends the group gets SIGTERM, then SIGKILL after the stop
// grace; what the program leaves running when it exits is stopped the
// same way; and when the worker dies the group is killed at once. No
// process of the group outlives its task or its worker.
//
// Imports: asynq, rules (the file), admission (ThrottledError, WaitedFrom),
// throttle (pauses) and httpthrottle (the HTTP transport); it must not
// import worker or enqueue: cmd/worker puts the two together.
package handler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Options are what the handlers need to run.
type Options struct {
	// Rules are the worker's limits. A task type that a rule applies to
	// pauses that rule's subject for every worker when its upstream
	// answers 429 or 503. If nil, such an answer only defers the task.
	Rules *rules.Config
	// Redis holds the limits. Required if Rules is set.
	Redis redis.UniversalClient
	// Getenv resolves ${VAR} in header and env values. If nil, os.Getenv
	// is used.
	Getenv func(string) string
	// Logger receives a line per failed attempt and per deferral; it
	// never sees header or env values. If nil, slog.Default() is used.
	Logger *slog.Logger
	// Metrics, if set, counts and times every attempt (NewMetrics).
	Metrics *Metrics
	// Base sends the http handlers' requests. If nil, a clone of
	// http.DefaultTransport is used. Redirects are never followed.
	Base http.RoundTripper
	// SetCost and SetCosts report what a task really cost to the
	// middleware that admitted it (worker.SetCost and worker.SetCosts,
	// which cmd/worker passes: this package does not import worker): an
	// http handler with llm: true reports its answer's usage through them.
	// If nil, such a handler settles nothing and its estimates stay
	// charged.
	SetCost  func(ctx context.Context, n int) error
	SetCosts func(ctx context.Context, c throttle.Costs) error
}

// Register adds a handler for every task type of c to mux. It resolves
// the ${VAR} references and builds the limiters; errors name the handler
// and what to fix (an unset variable, a program not found).
func (c *Config) Register(mux *asynq.ServeMux, opts Options) error {
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Rules != nil && opts.Redis == nil {
		return errors.New("handler: Options.Redis is nil; the rules' limits live in Redis")
	}
	for _, s := range c.Handlers {
		h, err := c.build(s, opts)
		if err != nil {
			return fmt.Errorf("handler: %s:%d: handler for %q: %w", c.File, s.Line, s.Task, err)
		}
		mux.Handle(s.Task, h)
	}
	return nil
}

// build returns the handler of s, observed (outcome.go).
func (c *Config) build(s Spec, opts Options) (asynq.Handler, error) {
	log := opts.Logger.With("task_type", s.Task)
	o := &observed{handler: s.Task, kind: kindCommand, log: log, metrics: opts.Metrics}
	if opts.Rules != nil {
		if rc, ok := opts.Rules.RuleFor(s.Task); ok {
			o.rule = rc.Name
		}
	}
	var err error
	if s.HTTP != nil {
		o.kind = kindHTTP
		o.next, err = newHTTPHandler(s, opts, log)
	} else {
		o.next, err = newCommandHandler(s, opts)
	}
	if err != nil {
		return nil, err
	}
	opts.Metrics.known(o.handler, o.kind)
	return o, nil
}

// payloadError is the error for a task whose payload the handler cannot
// use: archived at once.
func payloadError(task *asynq.Task, err error) error {
	return fmt.Errorf("handler: task %s (%s): %v; archived without retry: %w", taskID(task), task.Type(), err, asynq.SkipRetry)
}

// taskID is the task's asynq ID: the same for every retry and deferral
// of the task. It is "" for a task that no asynq server runs (one made
// with asynq.NewTask in a test).
func taskID(task *asynq.Task) string {
	if w := task.ResultWriter(); w != nil {
		return w.TaskID()
	}
	return ""
}

// writeResult stores out, cut to limit bytes, as the task's result.
func writeResult(task *asynq.Task, out []byte, limit int) error {
	if len(out) > limit {
		out = out[:limit]
	}
	if len(out) == 0 {
		return nil
	}
	if w := task.ResultWriter(); w != nil {
		if _, err := w.Write(out); err != nil {
			return fmt.Errorf("handler: storing the result: %w", err)
		}
	}
	return nil
}

// noRetryLeft reports whether asynq archives the task on any error: it
// has used every retry, so a deferral would archive it too.
func noRetryLeft(ctx context.Context) bool {
	n, ok1 := asynq.GetRetryCount(ctx)
	max, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && n >= max
}

// retryNote is what a failed attempt's error says of the task's next
// try: asynq retries it, unless it has used its retries.
func retryNote(ctx context.Context) string {
	if noRetryLeft(ctx) {
		return "no retry left: archived"
	}
	return "will retry"
}

// cappedBuffer keeps the first limit bytes written to it and discards
// the rest, reporting every write as complete.
type cappedBuffer struct {
	b     []byte
	limit int
	total int
}

func (c *cappedBuffer) Write(p []byte) (int, error) {
	c.total += len(p)
	if room := c.limit - len(c.b); room > 0 {
		c.b = append(c.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

// tailBuffer keeps the last size bytes written to it.
type tailBuffer struct {
	b    []byte
	size int
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if over := len(t.b) - t.size; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}
