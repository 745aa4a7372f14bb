package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// This file is the asynq side of admission: it maps a task to a subject,
// an ID and a deadline for the rule's admission.Gate, and a decision back
// to asynq: run the handler, or park (a *admission.ThrottledError for the task's
// turn, plus a wake-up in the ledger).

// ErrParked is the cause of a *admission.ThrottledError for a task parked until its
// turn, which is booked under its task ID: when it comes back, it runs on
// that turn without asking the limiter again.
var ErrParked = errors.New("worker: parked until its booked turn")

// ErrParkedInLine is the cause for a task parked in its subject's line
// (TaskRule.Horizon): no turn is booked yet; the line's serving books it
// and wakes the task. It matches ErrParked (errors.Is): a park all the same.
var ErrParkedInLine error = parkedInLine{}

type parkedInLine struct{}

func (parkedInLine) Error() string {
	return "worker: parked in its subject's line; its turn is booked when the line reaches it"
}

func (parkedInLine) Is(target error) bool { return target == ErrParked }

const (
	// earlyWaitUnwoken is the gate's EarlyWait without wake-ups: a parked
	// task then comes back by asynq's own schedule, in whole seconds, up to
	// a second and unwokenLead before its turn, and waits out the rest.
	earlyWaitUnwoken = 1500 * time.Millisecond
	// unwokenLead is how long before its turn, at least, asynq brings back
	// a parked task without wake-ups: more than its task and delayed-task
	// check intervals (as Configure sets them) together.
	unwokenLead = 300 * time.Millisecond
)

// admit decides for a task: the turn to run it on, or the error the
// handler must return (a *admission.ThrottledError to park or defer it,
// ctx.Err() if asynq ended it, an error wrapping asynq.SkipRetry if it can
// never run).
func (m *Middleware) admit(ctx context.Context, r *ruleGate, task *asynq.Task) (turn, error) {
	t, err := m.newTaskRun(ctx, r, task)
	if err != nil {
		m.metrics.decided(r.Name, admission.LabelError)
		return turn{}, err
	}
	if r.stack != nil {
		return m.admitStacked(ctx, t)
	}
	if t.Cost == 0 {
		// Free: nothing to charge, nothing to wait for. (The gate would
		// take a zero Cost as 1: it never sees this task.)
		w := admission.Wait{Rule: r.Name, Subject: t.Subject}
		m.admitted(t, w)
		return turn{Wait: w}, nil
	}
	if r.gate == nil || (t.lastAttempt && m.requeue == nil) {
		w, place, err := m.waitInPlace(ctx, t)
		return turn{Wait: w, place: place}, err
	}
	if err := m.gateRequest(ctx, t); err != nil {
		m.metrics.decided(r.Name, admission.LabelError)
		return turn{}, err
	}
	wctx, done := m.waitContext(ctx, t)
	defer done()
	m.metrics.waiting(r.Name, 1)
	d, err := r.gate.Admit(wctx, t.Request)
	m.metrics.waiting(r.Name, -1)
	switch {
	case err != nil:
		return turn{}, m.notAdmitted(ctx, wctx, t, err)
	case d.Outcome == admission.Run:
		w := admission.Wait{Rule: r.Name, Subject: t.Subject, Duration: d.Waited, Redeemed: d.Status == throttle.Redeemed, Turn: d.Slot, At: d.Due}
		m.admitted(t, w)
		return turn{Wait: w, place: d.Place, res: d.Reservation, cost: t.Cost, costs: t.Costs}, nil
	}
	return turn{}, m.park(ctx, t, d)
}

// waitContext returns the context a task waits for its turn in: ended by
// Drain (cause ErrDraining) and before the task's deadline; call done when
// the wait is over.
func (m *Middleware) waitContext(ctx context.Context, t *taskRun) (context.Context, func()) {
	wctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(m.drainCtx, func() { cancel(ErrDraining) })
	cancelEnd := context.CancelFunc(func() {})
	if end, ok := waitEnd(ctx, 0, t.start, false); ok {
		wctx, cancelEnd = context.WithDeadline(wctx, end)
	}
	return wctx, func() { cancelEnd(); stop(); cancel(nil) }
}

// gateRequest completes t's request for its rule's gate: who it books
// and waits as, its producer's receipt, its share. It returns the error
// that archives the task if its share cannot be derived.
func (m *Middleware) gateRequest(ctx context.Context, t *taskRun) error {
	// A task with no retry left parks as a copy (requeue.go): book the
	// turn under the copy's ID, which is the one that comes back.
	t.BookAs = t.ID
	if t.lastAttempt {
		t.BookAs = nextCopyID(t.ID)
	}
	// Under a concurrency rule, and in its subject's line, the task is
	// named by the wake-up ledger entry that brings it back.
	queue, _ := asynq.GetQueueName(ctx)
	t.Waiter = admission.JobEntry{Queue: queue, ID: t.ID}.Member()
	t.WaitAs = admission.JobEntry{Queue: queue, ID: t.BookAs}.Member()
	t.Receipt = t.task.Headers()[admission.ReceiptHeader]
	// Stacked rules (mux.Use(a.Wrap, b.Wrap) over the same task): a task
	// that one rule admits and another parks gives the first rule's turn
	// back, and comes back for the second rule's turn needing a turn of
	// the first again. Were either to put it at the back of its line, it
	// would lose the other's turn each time, for ever; so a rule inside
	// another (the outer admitted the task: WaitedFrom) or with one inside
	// it that has throttled a task books turns however far ahead, as
	// without a horizon. Each rule's own limit still holds.
	_, nested := admission.WaitedFrom(ctx)
	t.BookAhead = nested || t.rule.stacked.Load()
	if t.rule.Priority != nil {
		var err error
		if t.Priority, err = t.rule.Priority(ctx, t.task); err != nil {
			return t.archive(ctx, "worker: task archived: no priority", false, fmt.Errorf("cannot derive its priority: %w", err))
		}
	}
	if t.rule.FairBy == nil {
		return nil
	}
	var err error
	if t.Share, err = t.rule.FairBy(t.task); err != nil {
		return t.archive(ctx, "worker: task archived: no share", false, fmt.Errorf("cannot derive its fair_by share: %w", err))
	}
	return nil // the gate weighs the share (admission.Settings.Weights)
}

// park returns the error that parks a task d parked: until its turn, or,
// in its subject's line, until the serving that books it (d.At is a
// fallback). The gate has recorded its wake-ups (d.Woken); without them
// asynq brings it back by its own schedule.
func (m *Middleware) park(ctx context.Context, t *taskRun, d admission.Decision) error {
	if d.ParkErr != nil {
		t.log.WarnContext(ctx, "worker: parked, but its wake-ups are not all recorded", "error", d.ParkErr)
	}
	retryAt := d.At
	if !d.Woken {
		// Whole seconds, early: the task waits out the rest (earlyWaitUnwoken).
		retryAt = d.At.Add(-unwokenLead).Truncate(time.Second)
	}
	if d.InLine {
		return m.deferTask(ctx, t, retryAt, ErrParkedInLine, d.Label(), "reason", d.Reason())
	}
	t.booked, t.ahead = d.Slot, time.Until(d.At)
	m.metrics.parkedOn(t.rule.Name, d, t.ahead)
	return m.deferTask(ctx, t, retryAt, ErrParked, d.Label(),
		"reason", d.Reason(), "booked_for", d.Slot.UTC(), "booked_ahead", t.ahead.Round(time.Millisecond))
}

// turn is how admit lets a task run: the Wait its handler sees, whether
// it holds a place of a concurrency rule (to release when the handler
// returns), and the permits it took, to settle (settle.go).
type turn struct {
	admission.Wait
	place  *throttle.Place       // the place of a concurrency rule it holds; nil if none
	res    *throttle.Reservation // the turn's permits; nil if none to settle
	cost   int                   // the permits it took: the rule's Cost, an estimate
	costs  throttle.Costs        // or, with TaskRule.Costs, those under each rule of its limiter
	within []ruleTurn            // the turns of the rules it is within (TaskRule.Within)
}

// ruleTurn is a turn of a rule.
type ruleTurn struct {
	rule *ruleGate
	turn
}

// taskRun is what admit knows of the task it decides for: the request
// its rule's gate decides on (Subject, Cost and ID, then, for the gate,
// gateRequest's), and what the adapter keeps beside it.
type taskRun struct {
	admission.Request
	rule        *ruleGate
	task        *asynq.Task
	lastAttempt bool
	byMaxWait   bool          // the wait in place was bounded by the rule's MaxWait, not the deadline
	booked      time.Time     // a parked task's turn (Redis clock); zero if it parked in its subject's line
	ahead       time.Duration // how far ahead booked was
	start       time.Time
	log         *slog.Logger
}

// newTaskRun maps task to its subject, cost and ID under rule r, and tells
// whether it is on its last attempt. It returns the error that archives a
// task whose subject or cost cannot be derived.
func (m *Middleware) newTaskRun(ctx context.Context, r *ruleGate, task *asynq.Task) (*taskRun, error) {
	id, _ := asynq.GetTaskID(ctx)
	t := &taskRun{rule: r, task: task, start: time.Now(),
		log: m.log.With("rule", r.Name, "task_id", id, "task_type", task.Type())}
	t.ID = id
	subject, err := r.Subject(task)
	if err == nil && subject == "" {
		err = errors.New("the subject is empty")
	}
	if err != nil {
		return nil, t.archive(ctx, "worker: task archived: no subject", true, err)
	}
	t.Subject, t.log = subject, t.log.With("subject", subject)
	if t.Cost, err = r.cost(task); err != nil {
		return nil, t.archive(ctx, "worker: task archived: no cost", false, fmt.Errorf("cannot derive the cost: %w", err))
	}
	if r.Costs != nil {
		if t.Costs, t.Cost, err = r.costs(task); err != nil {
			return nil, t.archive(ctx, "worker: task archived: no cost", false, fmt.Errorf("cannot derive the costs: %w", err))
		}
	}
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, known := asynq.GetMaxRetry(ctx)
	t.lastAttempt = known && retried >= maxRetry
	return t, nil
}

// archive returns the error that archives a task that can never run;
// noSubject says its subject was the reason.
func (t *taskRun) archive(ctx context.Context, msg string, noSubject bool, err error) error {
	err = &archivedError{rule: t.rule.Name, taskID: t.ID, taskType: t.task.Type(), noSubject: noSubject, err: err}
	t.log.WarnContext(ctx, msg, "error", err)
	return err
}

// WakeOnHandoff returns a throttle.Options.OnHandoff that wakes the tasks
// a freed place of a concurrency rule was handed to, through the wake-up
// ledger in rdb (the asynq server's Redis, admission.WakeupsKey): the
// wake-up loop of any middleware with Options.Asynq moves them to pending
// at once. FromRules sets it on the limiters it builds (with Asynq); set it
// on limiters of your own that have a throttle.Concurrency rule.
// It writes to a ledger of admission.DefaultWakeupShards shards; a worker
// with other Options.WakeupShards gets its own from FromRules.
func WakeOnHandoff(rdb redis.UniversalClient) func(waiters []string) {
	return wakeOnHandoff(rdb, 0)
}

// wakeOnHandoff is WakeOnHandoff over a ledger of shards shards (0: the
// default); an invalid number falls back to the default, which
// NewMiddleware refuses anyway.
func wakeOnHandoff(rdb redis.UniversalClient, shards int) func(waiters []string) {
	wakeups, err := admission.NewShardedWakeups(rdb, admission.WakeupsKey, shards)
	if err != nil {
		wakeups, _ = admission.NewShardedWakeups(rdb, admission.WakeupsKey, 0)
	}
	return admission.WakeOnHandoff(wakeups)
}

// release gives back the place of a concurrency rule r that a task ran
// under, whatever its handler returned, bounded as r's limiter bounds what
// it gives back (Limiter.Detach), so that a release Redis loses is
// reported to its OnRedisError.
func (m *Middleware) release(r *ruleGate, place *throttle.Place, w admission.Wait) {
	ctx, cancel := r.gate.Limiter().Detach(context.Background())
	defer cancel()
	if err := place.Release(ctx); err != nil {
		m.log.Warn("worker: cannot release the task's place of a concurrency rule; it frees when its lease expires", "rule", w.Rule, "subject", w.Subject, "error", err)
	}
}

// wakeLoop runs the wake-up ledger until Drain. Its errors are logged at
// most once per wakeErrorEvery (with how many there were), so that a Redis
// outage does not log one line per tick.
func (m *Middleware) wakeLoop() {
	defer close(m.stopped)
	var mu sync.Mutex // OnError is called from concurrent wakes
	var last time.Time
	var since int
	_ = m.parking.Run(m.drainCtx, admission.RunOptions{
		OnError: func(err error) {
			m.metrics.OnRedisError(err, false)
			mu.Lock()
			defer mu.Unlock()
			if since++; time.Since(last) >= wakeErrorEvery {
				m.log.Warn("worker: wake-ups: parked tasks come back by asynq's own schedule until this clears", "error", err, "errors", since)
				last, since = time.Now(), 0
			}
		},
	}, m.wake)
}

// wakeErrorEvery spaces the wake-up loop's error logs.
const wakeErrorEvery = 10 * time.Second

// wake moves a parked task to its queue's pending list. A task that is
// gone (done, deleted) or already pending is left alone; one that is
// still running (its handler has not returned yet) is tried again later;
// an archived one is not revived.
func (m *Middleware) wake(_ context.Context, job admission.JobEntry) error {
	queue, id := job.Queue, job.ID
	info, err := m.requeue.insp.GetTaskInfo(queue, id)
	switch {
	case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("worker: wake-up of task %s: %w", id, err)
	}
	switch info.State {
	case asynq.TaskStateActive:
		return fmt.Errorf("worker: task %s is still running: %w", id, admission.ErrWakeLater)
	case asynq.TaskStateRetry, asynq.TaskStateScheduled:
	default:
		return nil
	}
	if err := m.requeue.insp.RunTask(queue, id); err != nil && !errors.Is(err, asynq.ErrTaskNotFound) {
		return fmt.Errorf("worker: wake-up of task %s: %w", id, err)
	}
	m.metrics.woken()
	return nil
}

// waitInPlace admits a task whose rule cannot park it (a Limiter that is
// not a *throttle.Limiter, or a task on its last attempt without
// Options.Asynq): it waits in its handler, bounded by the rule's MaxWait
// (unless it is on its last attempt) and its deadline, and is deferred to
// the limiter's answer if that is later.
func (m *Middleware) waitInPlace(ctx context.Context, t *taskRun) (admission.Wait, *throttle.Place, error) {
	r := t.rule
	canDefer := !t.lastAttempt || m.requeue != nil
	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if canDefer {
		stop := context.AfterFunc(m.drainCtx, func() { cancel(ErrDraining) })
		defer stop()
	}
	if end, ok := waitEnd(ctx, r.MaxWait, t.start, canDefer); ok {
		var cancelEnd context.CancelFunc
		wctx, cancelEnd = context.WithDeadline(wctx, end)
		defer cancelEnd()
		dl, hasDeadline := ctx.Deadline()
		t.byMaxWait = canDefer && r.MaxWait > 0 && (!hasDeadline || end.Before(dl.Add(-min(deadlineMargin, max(dl.Sub(t.start), 0)/4))))
	}
	m.metrics.waiting(r.Name, 1)
	var place *throttle.Place
	var err error
	if cw, ok := r.Limiter.(costsWaiter); ok && t.Costs != nil {
		err = cw.WaitCosts(wctx, t.Subject, t.Costs) // no place: costs per rule need no concurrency rule
	} else if r.gate != nil {
		place, err = r.gate.Acquire(wctx, t.Subject, t.Cost) // the same limiter, through its gate
	} else {
		err = r.Limiter.WaitN(wctx, t.Subject, t.Cost)
	}
	m.metrics.waiting(r.Name, -1)
	if err != nil {
		return admission.Wait{}, nil, m.notAdmitted(ctx, wctx, t, err)
	}
	w := admission.Wait{Rule: r.Name, Subject: t.Subject, Duration: time.Since(t.start)}
	m.admitted(t, w)
	return w, place, nil
}

// costsWaiter is a Limiter that waits for a cost per rule
// (*throttle.Limiter).
type costsWaiter interface {
	WaitCosts(ctx context.Context, subject string, c throttle.Costs) error
}

// isCostsWaiter reports whether l can wait for a cost per rule.
func isCostsWaiter(l Waiter) bool {
	_, ok := l.(costsWaiter)
	return ok
}

// notAdmitted returns what the handler returns when the wait for a turn
// ended in err: ctx.Err() if asynq ended the task (its permits refunded),
// a *admission.ThrottledError deferring it (Redis failed, Drain, or the turn is past
// its deadline), or an error archiving it (it can never be admitted).
func (m *Middleware) notAdmitted(ctx, wctx context.Context, t *taskRun, err error) error {
	r := t.rule
	now := time.Now()
	var delay *throttle.DelayError
	var retryAt time.Time
	outcome := admission.LabelDeferred
	switch {
	case ctx.Err() != nil:
		// asynq ended the task: on shutdown it has already put the task
		// back in its queue; a new turn was refunded.
		m.metrics.decided(r.Name, admission.LabelRefunded)
		t.log.InfoContext(ctx, "worker: wait ended by asynq; permits refunded", "waited", now.Sub(t.start), "error", ctx.Err())
		return ctx.Err()
	case errors.As(err, &delay):
		retryAt = now.Add(delay.RetryAfter)
		if delay.Deadline && t.byMaxWait {
			// The limiter saw a context deadline, but that deadline was
			// the rule's max_wait: say so.
			err = &maxWaitError{cause: &throttle.DelayError{Rule: delay.Rule, RetryAfter: delay.RetryAfter}, maxWait: r.MaxWait}
		}
	case errors.Is(err, throttle.ErrRedis):
		outcome = admission.LabelError
		retryAt = now.Add(m.redisRetry)
		t.log.WarnContext(ctx, "worker: limiter cannot reach Redis; deferring the task", "error", err, "retry_in", m.redisRetry)
	case context.Cause(wctx) == ErrDraining:
		err = ErrDraining
		retryAt = now
	case wctx.Err() != nil:
		// The bound passed while the task was queued behind others in
		// this process (window rules waiting in place): no admission
		// time is known, so defer it by as long as it has waited.
		bound := "the task's deadline"
		if t.byMaxWait {
			bound = fmt.Sprintf("the rule's max_wait of %v", r.MaxWait)
		}
		err = fmt.Errorf("worker: the wait for a turn reached %s while queued behind others in this process: %w", bound, wctx.Err())
		retryAt = now.Add(now.Sub(t.start))
	case errors.Is(err, throttle.ErrInvalidSubject):
		m.metrics.decided(r.Name, admission.LabelError)
		return t.archive(ctx, "worker: task archived: it can never be admitted", true, err)
	case errors.Is(err, throttle.ErrExceedsCapacity):
		m.metrics.decided(r.Name, admission.LabelError)
		return t.archive(ctx, "worker: task archived: it can never be admitted", false, err)
	default:
		m.metrics.decided(r.Name, admission.LabelError)
		return fmt.Errorf("worker: rule %q: %w", r.Name, err)
	}
	return m.deferTask(ctx, t, retryAt, err, outcome)
}

// admitted records an admission.
func (m *Middleware) admitted(t *taskRun, w admission.Wait) {
	rule := t.rule.Name
	m.metrics.waited(rule, w.Duration)
	if us, err := strconv.ParseInt(t.task.Headers()[admission.EnqueuedHeader], 10, 64); err == nil && us > 0 {
		m.metrics.startDelay(rule, time.Since(time.UnixMicro(us)))
	}
	attrs := []any{"waited", w.Duration.Round(time.Millisecond)}
	if !w.Turn.IsZero() {
		attrs = append(attrs, "turn", w.Turn.UTC())
	}
	label, level := w.Label(), slog.LevelDebug // admission/status.go
	m.metrics.decided(rule, label)
	if reason := w.Reason(); reason != "" {
		attrs = append(attrs, "reason", reason)
	}
	if label == admission.LabelWaited && w.Duration >= time.Second {
		level = slog.LevelInfo
	}
	t.log.Log(context.Background(), level, "worker: admitted", attrs...)
}

// deferTask returns the *admission.ThrottledError that defers the task to retryAt,
// requeueing a copy first if the task has no retry left. attrs are added
// to its log entry.
func (m *Middleware) deferTask(ctx context.Context, t *taskRun, retryAt time.Time, cause error, outcome string, attrs ...any) error {
	rule := t.rule.Name
	te := &admission.ThrottledError{Rule: rule, Subject: t.Subject, RetryAt: retryAt, Err: cause}
	if t.lastAttempt {
		if m.requeue == nil {
			m.metrics.decided(rule, admission.LabelError)
			t.log.ErrorContext(ctx, "worker: task archived: throttled past its deadline on its last attempt; set worker.Options.Asynq to defer such tasks", "error", te)
			return te
		}
		copyID, err := m.requeue.copy(ctx, t.task, t.ID, retryAt)
		if err != nil {
			m.metrics.decided(rule, admission.LabelError)
			te.Err = errors.Join(cause, err)
			t.log.ErrorContext(ctx, "worker: task archived: could not requeue it on its last attempt", "error", te)
			return te
		}
		te.Requeued = copyID
	}
	m.metrics.decided(rule, outcome)
	attrs = append(attrs, "retry_at", retryAt, "retry_in", time.Until(retryAt).Round(time.Millisecond), "cause", cause)
	if te.Requeued != "" {
		attrs = append(attrs, "requeued_as", te.Requeued)
	}
	msg, level := "worker: task deferred", slog.LevelInfo
	if outcome == admission.LabelParked {
		// One line per park would flood the log under a backlog: Debug,
		// and a summary per rule at Info (parklog.go).
		msg, level = "worker: task parked until its turn", slog.LevelDebug
		m.parks.add(rule, t.booked, t.ahead)
	}
	t.log.Log(ctx, level, msg, attrs...)
	if te.Requeued != "" {
		return revokedError{te}
	}
	return te
}

// deadlineMargin is how long before the task's deadline every wait ends,
// so that the middleware, not asynq's deadline handling, decides the
// task's fate (asynq counts a task whose context expires as failed). It is
// at most a quarter of the time the task has.
const deadlineMargin = 500 * time.Millisecond

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

// maxWaitError is the cause of a deferral whose turn is past the rule's
// MaxWait (a limiter that cannot book, waiting in place). It unwraps to a
// *throttle.DelayError whose bound was not the context's deadline.
type maxWaitError struct {
	cause   *throttle.DelayError
	maxWait time.Duration
}

func (e *maxWaitError) Error() string {
	return fmt.Sprintf("worker: its turn, in %v, is past the rule's max_wait of %v", e.cause.RetryAfter.Round(time.Millisecond), e.maxWait)
}

func (e *maxWaitError) Unwrap() error { return e.cause }
