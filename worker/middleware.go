package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Waiter is what a Rule waits on for each task: a *throttle.Limiter or a
// *throttle.Group.
type Waiter interface {
	// WaitN blocks until n permits for subject are granted, fails at once
	// with a *throttle.DelayError if they would come after ctx's deadline,
	// and refunds them and returns ctx.Err() if ctx ends while waiting.
	WaitN(ctx context.Context, subject string, n int) error
}

var (
	_ Waiter = (*throttle.Limiter)(nil)
	_ Waiter = (*throttle.Group)(nil)
)

// Rule binds task types to a limiter and a subject.
type Rule struct {
	// Name identifies the rule in errors, logs and the rule label of the
	// metrics. Required, and unique within a Middleware.
	Name string
	// Tasks are the task types the rule applies to: an exact type such as
	// "email:send", or a pattern ending in '*' that matches every type with
	// that prefix, such as "stripe:*" ("*" alone matches every type). A
	// type matched by several rules takes the exact one, else the longest
	// prefix. At least one; no pattern may appear in two rules.
	Tasks []string
	// Limiter grants each task one permit. Required.
	Limiter Waiter
	// Subject derives what the rule limits from the task. Required; use
	// Fixed for one limit shared by every task of the rule.
	Subject Subject
	// MaxWait bounds how long a task may wait in its handler, holding a
	// worker slot. A task whose admission would come later is deferred
	// with a *ThrottledError instead. If zero, only the task's deadline
	// bounds the wait.
	MaxWait time.Duration
}

// ReceiptHeader is the asynq task header that carries a receipt from
// throttle.Limiter.PrepayN: a task paced at enqueue time under the same
// limiter and subject. The middleware redeems it instead of charging the
// rule again, and waits only if the task came before its slot. A receipt
// that does not redeem (unknown, expired, used, or for other rules) is
// ignored and the task is charged as usual.
const ReceiptHeader = "jobthrottle-receipt"

// deadlineMargin is how long before the task's deadline every wait ends,
// so that the middleware, not asynq's deadline handling, decides the
// task's fate (asynq counts a task whose context expires as failed). It is
// at most a quarter of the time the task has.
const deadlineMargin = 500 * time.Millisecond

// DefaultRedisRetryDelay is how long a task is deferred when its limiter
// cannot reach Redis (and is not fail-open), unless WithRedisRetryDelay
// says otherwise.
const DefaultRedisRetryDelay = 5 * time.Second

// Middleware throttles asynq tasks by rules. Use its Wrap method as an
// asynq.MiddlewareFunc: mux.Use(mw.Wrap). Tasks whose type no rule
// matches pass through untouched.
//
// For each matched task it derives the subject, then waits on the rule's
// limiter for one permit, bounded by the rule's MaxWait and the task's
// deadline. If the permit would come later, it returns a *ThrottledError
// with the admission time, and asynq reschedules the task for that time
// without counting a failure, provided the server's asynq.Config uses
// IsFailure and RetryDelay (Configure sets both).
//
// A Middleware is safe for concurrent use.
type Middleware struct {
	exact      map[string]*Rule
	prefixes   []prefixRule // longest prefix first
	log        *slog.Logger
	metrics    *Metrics
	requeue    *requeuer
	redisRetry time.Duration
	drainCtx   context.Context
	drain      context.CancelFunc
}

type prefixRule struct {
	prefix string
	rule   *Rule
}

// Option configures a Middleware.
type Option func(*options)

type options struct {
	logger     *slog.Logger
	metrics    *Metrics
	requeue    redis.UniversalClient
	redisRetry time.Duration
}

// WithLogger sets the structured logger. If unset, slog.Default() is used.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithMetrics records the middleware's decisions in m.
func WithMetrics(m *Metrics) Option { return func(o *options) { o.metrics = m } }

// WithRequeue lets the middleware defer tasks that have no retry left
// (enqueued with asynq.MaxRetry(0), or on their last attempt after real
// failures), which asynq would archive if their handler returned any
// error. rdb is the Redis client of the asynq server. Such a task is
// deferred by enqueueing a copy (same type, payload, headers, queue,
// timeout, deadline and retention; the retries it had left; the ID
// "<id>~throttled<n>") scheduled for RetryAt, and revoking the original
// (the returned *ThrottledError then matches asynq.RevokeTask).
//
// Without WithRequeue, such a task waits in its handler as long as its
// deadline allows, ignoring MaxWait, and is archived with a
// *ThrottledError only if even that is not enough.
func WithRequeue(rdb redis.UniversalClient) Option { return func(o *options) { o.requeue = rdb } }

// WithRedisRetryDelay sets how long a task is deferred when its limiter
// cannot reach Redis. If unset or not positive, DefaultRedisRetryDelay.
func WithRedisRetryDelay(d time.Duration) Option { return func(o *options) { o.redisRetry = d } }

// NewMiddleware returns a Middleware applying rules. It returns an error
// naming the rule and field if a rule is incomplete (no name, no tasks, no
// Limiter or no Subject), if two rules share a name or a pattern, or if a
// pattern is empty or has a '*' other than at its end.
func NewMiddleware(rules []Rule, opts ...Option) (*Middleware, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	m := &Middleware{
		exact:      map[string]*Rule{},
		log:        o.logger,
		metrics:    o.metrics,
		redisRetry: o.redisRetry,
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	if m.redisRetry <= 0 {
		m.redisRetry = DefaultRedisRetryDelay
	}
	if o.requeue != nil {
		m.requeue = &requeuer{client: asynq.NewClientFromRedisClient(o.requeue), insp: asynq.NewInspectorFromRedisClient(o.requeue)}
	}
	m.drainCtx, m.drain = context.WithCancel(context.Background())

	names := map[string]bool{}
	owner := map[string]string{}
	for i := range rules {
		r := &rules[i]
		bad := func(field, reason string) error {
			return fmt.Errorf("worker: rule %q: %s: %s", r.Name, field, reason)
		}
		switch {
		case r.Name == "":
			return nil, fmt.Errorf("worker: rule %d: name: must not be empty", i)
		case names[r.Name]:
			return nil, bad("name", "is used by two rules; names must be unique")
		case len(r.Tasks) == 0:
			return nil, bad("tasks", "must list at least one task type or pattern")
		case r.Limiter == nil:
			return nil, bad("limiter", "must not be nil; use a *throttle.Limiter or *throttle.Group")
		case r.Subject == nil:
			return nil, bad("subject", "must not be nil; use Fixed, PayloadField or a func")
		case r.MaxWait < 0:
			return nil, bad("max_wait", fmt.Sprintf("%v must not be negative", r.MaxWait))
		}
		names[r.Name] = true
		rule := *r
		rule.Tasks = append([]string(nil), r.Tasks...)
		for _, p := range rule.Tasks {
			if err := checkPattern(p); err != nil {
				return nil, bad("tasks", err.Error())
			}
			if other, dup := owner[p]; dup {
				return nil, bad("tasks", fmt.Sprintf("pattern %q is also in rule %q; a task type takes one rule", p, other))
			}
			owner[p] = r.Name
			if prefix, ok := strings.CutSuffix(p, "*"); ok {
				m.prefixes = append(m.prefixes, prefixRule{prefix, &rule})
			} else {
				m.exact[p] = &rule
			}
		}
	}
	sort.SliceStable(m.prefixes, func(i, j int) bool { return len(m.prefixes[i].prefix) > len(m.prefixes[j].prefix) })
	return m, nil
}

// checkPattern reports whether p is a valid task type or pattern.
func checkPattern(p string) error {
	switch {
	case p == "":
		return errors.New(`pattern "" is empty; give a task type such as "email:send" or a prefix pattern such as "stripe:*"`)
	case strings.Contains(strings.TrimSuffix(p, "*"), "*"):
		return fmt.Errorf(`pattern %q: '*' may only end a pattern, as in "stripe:*"`, p)
	}
	return nil
}

// rule returns the rule for a task type, or nil.
func (m *Middleware) rule(taskType string) *Rule {
	if r, ok := m.exact[taskType]; ok {
		return r
	}
	for _, p := range m.prefixes {
		if strings.HasPrefix(taskType, p.prefix) {
			return p.rule
		}
	}
	return nil
}

// Wrap returns next throttled by the middleware's rules: an
// asynq.MiddlewareFunc for ServeMux.Use.
func (m *Middleware) Wrap(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		r := m.rule(task.Type())
		if r == nil {
			return next.ProcessTask(ctx, task)
		}
		w, err := m.admit(ctx, r, task)
		if err != nil {
			return err
		}
		return next.ProcessTask(context.WithValue(ctx, waitKey{}, w), task)
	})
}

// Drain ends every wait in progress, deferring those tasks (cause
// ErrDraining, RetryAt now: another worker takes them up), and makes every
// later throttled task defer at once. Call it when shutting down, after
// asynq.Server.Stop and before Shutdown, so that Shutdown does not wait up
// to ShutdownTimeout for tasks that are only waiting. Tasks on their last
// attempt are not drained unless WithRequeue is set (deferring would
// archive them); asynq puts them back in their queue when ShutdownTimeout
// passes. Drain cannot be undone.
func (m *Middleware) Drain() { m.drain() }

// Wait tells a handler how the middleware admitted its task; see
// WaitedFrom.
type Wait struct {
	Rule     string        // the rule that admitted the task
	Subject  string        // the subject it limited
	Duration time.Duration // how long the task waited for its permit
	Redeemed bool          // admitted on a prepaid receipt (ReceiptHeader)
}

type waitKey struct{}

// WaitedFrom returns how the middleware admitted the task whose handler
// context is ctx, and false if no rule applied. Handlers may include it in
// their result (task.ResultWriter()); the middleware itself writes no
// result, so it never clobbers the handler's.
func WaitedFrom(ctx context.Context) (Wait, bool) {
	w, ok := ctx.Value(waitKey{}).(Wait)
	return w, ok
}

// redeemer is implemented by *throttle.Limiter: limiters that can take a
// receipt prepaid at enqueue time.
type redeemer interface {
	Redeem(ctx context.Context, subject, receipt string) (time.Duration, bool, error)
}

var _ redeemer = (*throttle.Limiter)(nil)

// admit waits for the task's permit, or returns the error the handler
// must return: a *ThrottledError to defer it, ctx.Err() if asynq ended
// it, or an error wrapping asynq.SkipRetry if it can never be admitted.
func (m *Middleware) admit(ctx context.Context, r *Rule, task *asynq.Task) (Wait, error) {
	id, _ := asynq.GetTaskID(ctx)
	subject, err := r.Subject(task)
	if err == nil && subject == "" {
		err = errors.New("the subject is empty")
	}
	if err != nil {
		m.metrics.decided(r.Name, OutcomeError)
		err = &subjectError{rule: r.Name, taskID: id, taskType: task.Type(), err: err}
		m.log.WarnContext(ctx, "worker: task archived: no subject", "rule", r.Name, "task_id", id, "task_type", task.Type(), "error", err)
		return Wait{}, err
	}
	log := m.log.With("rule", r.Name, "task_id", id, "task_type", task.Type(), "subject", subject)
	start := time.Now()

	if receipt := task.Headers()[ReceiptHeader]; receipt != "" {
		if w, ok, err := m.redeem(ctx, log, r, subject, receipt, start); ok || err != nil {
			return w, err
		}
	}

	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, known := asynq.GetMaxRetry(ctx)
	lastAttempt := known && retried >= maxRetry
	canDefer := !lastAttempt || m.requeue != nil

	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if canDefer {
		stop := context.AfterFunc(m.drainCtx, func() { cancel(ErrDraining) })
		defer stop()
	}
	if end, ok := waitEnd(ctx, r.MaxWait, start, canDefer); ok {
		var cancelEnd context.CancelFunc
		wctx, cancelEnd = context.WithDeadline(wctx, end)
		defer cancelEnd()
	}

	m.metrics.waiting(r.Name, 1)
	err = r.Limiter.WaitN(wctx, subject, 1)
	m.metrics.waiting(r.Name, -1)
	now := time.Now()
	waited := now.Sub(start)

	if err == nil {
		m.admitted(log, r.Name, waited)
		return Wait{Rule: r.Name, Subject: subject, Duration: waited}, nil
	}

	var delay *throttle.DelayError
	var retryAt time.Time
	outcome := OutcomeDeferred
	switch {
	case ctx.Err() != nil:
		// asynq ended the task: on shutdown it has already put the task
		// back in its queue; WaitN refunded the permits.
		m.metrics.decided(r.Name, OutcomeRefunded)
		log.InfoContext(ctx, "worker: wait ended by asynq; permits refunded", "waited", waited, "error", ctx.Err())
		return Wait{}, ctx.Err()
	case errors.As(err, &delay):
		retryAt = now.Add(delay.RetryAfter)
	case errors.Is(err, throttle.ErrRedis):
		outcome = OutcomeError
		retryAt = now.Add(m.redisRetry)
		log.WarnContext(ctx, "worker: limiter cannot reach Redis; deferring the task", "error", err, "retry_in", m.redisRetry)
	case context.Cause(wctx) == ErrDraining:
		err = ErrDraining
		retryAt = now
	case wctx.Err() != nil:
		// The bound passed while the task was queued behind others in
		// this process (window rules): no admission time is known, so
		// defer it by as long as it has waited.
		err = wctx.Err()
		retryAt = now.Add(waited)
	case errors.Is(err, throttle.ErrInvalidSubject), errors.Is(err, throttle.ErrExceedsCapacity):
		m.metrics.decided(r.Name, OutcomeError)
		err = &subjectError{rule: r.Name, taskID: id, taskType: task.Type(), err: err}
		log.WarnContext(ctx, "worker: task archived: it can never be admitted", "error", err)
		return Wait{}, err
	default:
		m.metrics.decided(r.Name, OutcomeError)
		return Wait{}, fmt.Errorf("worker: rule %q: %w", r.Name, err)
	}
	return Wait{}, m.deferTask(ctx, log, r.Name, subject, task, id, retryAt, err, lastAttempt, outcome)
}

// waitEnd returns when a wait that began at start must end: before the
// task's deadline by deadlineMargin (at most a quarter of the time left),
// and, if the task can be deferred, after maxWait.
func waitEnd(ctx context.Context, maxWait time.Duration, start time.Time, canDefer bool) (time.Time, bool) {
	var end time.Time
	if dl, ok := ctx.Deadline(); ok {
		end = dl.Add(-min(deadlineMargin, max(dl.Sub(start), 0)/4))
	}
	if canDefer && maxWait > 0 {
		if e := start.Add(maxWait); end.IsZero() || e.Before(end) {
			end = e
		}
	}
	return end, !end.IsZero()
}

// admitted records an admission.
func (m *Middleware) admitted(log *slog.Logger, rule string, waited time.Duration) {
	m.metrics.waited(rule, waited)
	switch {
	case waited < WaitThreshold:
		m.metrics.decided(rule, OutcomeAdmitted)
		log.Debug("worker: admitted")
	default:
		m.metrics.decided(rule, OutcomeWaited)
		level := slog.LevelDebug
		if waited >= time.Second {
			level = slog.LevelInfo
		}
		log.Log(context.Background(), level, "worker: admitted after waiting", "waited", waited.Round(time.Millisecond))
	}
}

// redeem admits a task on a prepaid receipt. ok is false if the rule's
// limiter takes no receipts or the receipt does not redeem: the task is
// then charged as usual.
func (m *Middleware) redeem(ctx context.Context, log *slog.Logger, r *Rule, subject, receipt string, start time.Time) (Wait, bool, error) {
	rd, ok := r.Limiter.(redeemer)
	if !ok {
		return Wait{}, false, nil
	}
	delay, ok, err := rd.Redeem(ctx, subject, receipt)
	if err != nil || !ok {
		log.DebugContext(ctx, "worker: receipt not redeemed; charging the task", "error", err)
		return Wait{}, false, nil
	}
	if delay > 0 {
		// The task came before its slot (asynq schedules in whole
		// seconds, rounding down). The permit is paid; wait for it.
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			m.metrics.decided(r.Name, OutcomeRefunded)
			return Wait{}, true, ctx.Err()
		}
	}
	waited := time.Since(start)
	m.metrics.waited(r.Name, waited)
	m.metrics.decided(r.Name, OutcomeRedeemed)
	log.DebugContext(ctx, "worker: admitted on a prepaid receipt", "waited", waited)
	return Wait{Rule: r.Name, Subject: subject, Duration: waited, Redeemed: true}, true, nil
}

// deferTask returns the *ThrottledError that defers the task to retryAt,
// requeueing a copy first if the task has no retry left.
func (m *Middleware) deferTask(ctx context.Context, log *slog.Logger, rule, subject string, task *asynq.Task, id string, retryAt time.Time, cause error, lastAttempt bool, outcome string) error {
	te := &ThrottledError{Rule: rule, Subject: subject, RetryAt: retryAt, Err: cause}
	if lastAttempt {
		if m.requeue == nil {
			m.metrics.decided(rule, OutcomeError)
			log.ErrorContext(ctx, "worker: task archived: throttled past its deadline on its last attempt; use WithRequeue to defer such tasks", "error", te)
			return te
		}
		copyID, err := m.requeue.copy(ctx, task, id, retryAt)
		if err != nil {
			m.metrics.decided(rule, OutcomeError)
			te.Err = errors.Join(cause, err)
			log.ErrorContext(ctx, "worker: task archived: could not requeue it on its last attempt", "error", te)
			return te
		}
		te.Requeued = copyID
	}
	m.metrics.decided(rule, outcome)
	attrs := []any{"retry_at", retryAt, "retry_in", time.Until(retryAt).Round(time.Millisecond), "cause", cause}
	if te.Requeued != "" {
		attrs = append(attrs, "requeued_as", te.Requeued)
	}
	log.InfoContext(ctx, "worker: task deferred", attrs...)
	return te
}
