package handler

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
)

// Outcomes of one attempt of a handler, the values of the outcome label
// of jobthrottle_handler_attempts_total. The set is fixed; every outcome
// but OutcomeSuccess and OutcomeThrottled is a failed attempt, logged.
const (
	// OutcomeSuccess: the task completed (a 2xx answer, exit code 0).
	OutcomeSuccess = "success"
	// OutcomeHTTP4xx: the upstream refused the request, a 4xx other than
	// 429 (or a 3xx: redirects are never followed); archived at once.
	OutcomeHTTP4xx = "http_4xx"
	// OutcomeHTTP5xx: the upstream failed, a 5xx other than 503; retried.
	OutcomeHTTP5xx = "http_5xx"
	// OutcomeThrottled: deferred, not failed: the upstream answered 429
	// or 503, another worker had paused its subject, or the limit learned
	// from it had no slot soon enough (nothing was sent then). Asynq
	// reschedules the task without counting a failure (worker.Configure).
	OutcomeThrottled = "throttled"
	// OutcomeTimeout: no answer within the handler's timeout, a command
	// killed at its timeout, or the task's own deadline passed.
	OutcomeTimeout = "timeout"
	// OutcomeExitNonzero: the command exited with a code other than 0.
	OutcomeExitNonzero = "exit_nonzero"
	// OutcomeSignal: a signal the handler did not send ended the command
	// (the kernel's OOM killer, a crash).
	OutcomeSignal = "signal"
	// OutcomeCanceled: the task's context was cancelled while it ran
	// (asynq.Inspector.CancelProcessing, the worker stopping).
	OutcomeCanceled = "canceled"
	// OutcomeError: anything else: a payload the handler cannot use, a
	// connection error, a command that could not start, a result that
	// could not be stored.
	OutcomeError = "error"
)

// Kinds of handler, the values of the kind label.
const (
	kindHTTP    = "http"
	kindCommand = "command"
)

// outcomesOf are the outcomes a handler of each kind can have, whose
// series are created at zero when its handler is registered.
var outcomesOf = map[string][]string{
	kindHTTP:    {OutcomeSuccess, OutcomeHTTP4xx, OutcomeHTTP5xx, OutcomeThrottled, OutcomeTimeout, OutcomeCanceled, OutcomeError},
	kindCommand: {OutcomeSuccess, OutcomeExitNonzero, OutcomeSignal, OutcomeTimeout, OutcomeCanceled, OutcomeError},
}

// attemptError is the error of a failed attempt with what its log entry
// and metrics say of it. Its text is the wrapped error's: what asynq
// keeps as the task's last error.
type attemptError struct {
	outcome  string
	status   int    // the HTTP status; 0 if there was no answer
	exitCode int    // the command's exit code; 0 if it did not exit with one
	signal   string // the signal that ended the command; "" if none
	err      error
}

func (e *attemptError) Error() string { return e.err.Error() }
func (e *attemptError) Unwrap() error { return e.err }

// attempt is how one attempt ended, as classify reads it.
type attempt struct {
	attemptError
	retry bool // asynq will run the task again (a failed attempt)
}

// failed reports whether the attempt failed: not a success, and not a
// deferral (which asynq does not count as a failure).
func (a attempt) failed() bool {
	return a.outcome != OutcomeSuccess && a.outcome != OutcomeThrottled
}

// classify reads how an attempt that returned err under ctx ended. The
// task's context ending decides first: whatever the handler made of it,
// that is why the attempt ended.
func classify(ctx context.Context, err error) attempt {
	a := attempt{retry: willRetry(ctx, err)}
	var ae *attemptError
	var te *admission.ThrottledError
	switch {
	case err == nil:
		a.outcome = OutcomeSuccess
	case errors.As(err, &te):
		a.outcome = OutcomeThrottled
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		a.outcome = OutcomeTimeout
	case ctx.Err() != nil:
		a.outcome = OutcomeCanceled
	case errors.As(err, &ae):
		a.attemptError = *ae
	default:
		a.outcome = OutcomeError
	}
	return a
}

// willRetry reports whether asynq runs a task again after its handler
// returned err: not for an error that says not to (asynq.SkipRetry,
// asynq.RevokeTask), nor for a task that has used its retries.
func willRetry(ctx context.Context, err error) bool {
	if errors.Is(err, asynq.SkipRetry) || errors.Is(err, asynq.RevokeTask) {
		return false
	}
	return !noRetryLeft(ctx)
}

// observed is a handler whose every attempt is counted and timed, and
// whose every failed attempt is logged: one line, at Warn when asynq will
// retry the task, at Error when it will not. It adds no Redis call.
type observed struct {
	next    asynq.Handler
	handler string // the handler's task type, its label
	kind    string // kindHTTP or kindCommand
	rule    string // the rule that limits the task type; "" if none
	log     *slog.Logger
	metrics *Metrics
}

func (o *observed) ProcessTask(ctx context.Context, task *asynq.Task) error {
	start := time.Now()
	err := o.next.ProcessTask(ctx, task)
	d := time.Since(start)
	a := classify(ctx, err)
	o.metrics.attempted(o.handler, o.kind, a.outcome, d)
	if a.failed() {
		o.logFailure(ctx, task, a, d, err)
	}
	return err
}

// logFailure logs the failed attempt a of task, which took d and
// returned err.
func (o *observed) logFailure(ctx context.Context, task *asynq.Task, a attempt, d time.Duration, err error) {
	attrs := []any{"task_id", taskID(task), "kind", o.kind, "outcome", a.outcome}
	if o.rule != "" {
		attrs = append(attrs, "rule", o.rule)
	}
	switch {
	case a.status != 0:
		attrs = append(attrs, "status", a.status)
	case a.exitCode != 0:
		attrs = append(attrs, "exit_code", a.exitCode)
	}
	if a.signal != "" {
		attrs = append(attrs, "signal", a.signal)
	}
	attrs = append(attrs, "duration", d.Round(time.Millisecond), "retry", a.retry)
	if n, ok := asynq.GetRetryCount(ctx); ok {
		attrs = append(attrs, "retried", n)
	}
	if n, ok := asynq.GetMaxRetry(ctx); ok {
		attrs = append(attrs, "max_retry", n)
	}
	attrs = append(attrs, "error", err)
	if a.retry {
		o.log.WarnContext(ctx, "handler: the task failed; asynq will retry it", attrs...)
		return
	}
	o.log.ErrorContext(ctx, "handler: the task failed and will not be retried; asynq archives it", attrs...)
}
