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
func (m *Middleware) admit(ctx context.Context, r *ruleGate, task *asynq.Task) (_ turn, err error) {
	t := m.newTaskRun(ctx, r, task)
	subject, err := r.Subject(task)
	if err == nil && subject == "" {
		err = errors.New("the subject is empty")
	}
	if err != nil {
		m.metrics.decided(r.Name, OutcomeError)
		return turn{}, t.archive(ctx, "worker: task archived: no subject", true, err)
	}
	t.subject, t.log = subject, t.log.With("subject", subject)
	if t.cost, err = r.cost(task); err != nil {
		m.metrics.decided(r.Name, OutcomeError)
		return turn{}, t.archive(ctx, "worker: task archived: no cost", false, fmt.Errorf("cannot derive the cost: %w", err))
	}
	if t.cost == 0 {
		// Free: nothing to charge, nothing to wait for.
		w := admission.Wait{Rule: r.Name, Subject: subject}
		m.admitted(t, w)
		return turn{Wait: w}, nil
	}

	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, known := asynq.GetMaxRetry(ctx)
	t.lastAttempt = known && retried >= maxRetry
	if r.gate == nil || (t.lastAttempt && m.requeue == nil) {
		w, err := m.waitInPlace(ctx, t)
		return turn{Wait: w, held: err == nil && r.leased}, err
	}

	wctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(m.drainCtx, func() { cancel(ErrDraining) })
	defer stop()
	if end, ok := waitEnd(ctx, 0, t.start, false); ok {
		var cancelEnd context.CancelFunc
		wctx, cancelEnd = context.WithDeadline(wctx, end)
		defer cancelEnd()
	}
	// A task with no retry left parks as a copy (requeue.go): book the
	// turn under the copy's ID, which is the one that comes back.
	bookID := t.id
	if t.lastAttempt {
		bookID = nextCopyID(t.id)
	}
	// Under a concurrency rule, the task waits for a place as the wake-up
	// member that brings it back (WakeOnHandoff).
	queue, _ := asynq.GetQueueName(ctx)
	req := admission.Request{Subject: subject, Cost: t.cost, ID: t.id, BookAs: bookID, Receipt: task.Headers()[admission.ReceiptHeader],
		Waiter: admission.Member(queue, t.id), WaitAs: admission.Member(queue, bookID)}
	// Stacked rules (mux.Use(a.Wrap, b.Wrap) over the same task): a task
	// that one rule admits and another parks gives the first rule's turn
	// back, and comes back for the second rule's turn needing a turn of
	// the first again. Were either to put it at the back of its line, it
	// would lose the other's turn each time, for ever; so a rule inside
	// another (the outer admitted the task: WaitedFrom) or with one inside
	// it that has throttled a task books turns however far ahead, as
	// without a horizon. Each rule's own limit still holds.
	if _, nested := admission.WaitedFrom(ctx); nested || r.stacked.Load() {
		req.BookAhead = true
	}
	if r.FairBy != nil {
		if req.Share, err = r.FairBy(task); err != nil {
			m.metrics.decided(r.Name, OutcomeError)
			return turn{}, t.archive(ctx, "worker: task archived: no share", false, fmt.Errorf("cannot derive its fair_by share: %w", err))
		}
		req.Weight = r.Weights[req.Share]
	}
	m.metrics.waiting(r.Name, 1)
	d, err := r.gate.Admit(wctx, req)
	m.metrics.waiting(r.Name, -1)
	if err != nil {
		return turn{}, m.notAdmitted(ctx, wctx, t, err)
	}
	if d.Outcome == admission.Run {
		w := admission.Wait{Rule: r.Name, Subject: subject, Duration: d.Waited, Redeemed: d.Turn == throttle.Redeemed, Turn: d.Slot}
		m.admitted(t, w)
		return turn{Wait: w, held: d.Lease > 0, res: d.Reservation, cost: t.cost}, nil
	}
	if d.Lease > 0 {
		// Queued for a place of the concurrency rule d.Rule.
		m.sweepLater(ctx, t, d)
	}
	if !d.Serve.IsZero() && m.wakeups != nil {
		// The task started its subject's line, or came back still in it:
		// a serving is due then (the loop takes a member Lead before its
		// time). Moved, not added if absent: a serving's guard (serveLine)
		// may still be in the ledger from a line that emptied, later than
		// this one needs.
		if err := m.wakeups.Add(ctx, sweepMember(r.Name, subject), d.Serve.Add(admission.DefaultLead)); err != nil {
			t.log.WarnContext(ctx, "worker: cannot schedule the serving of the subject's line; its tasks come back at their fallbacks", "error", err)
		}
	}
	retryAt := m.parkAt(ctx, t, bookID, d)
	if d.InLine {
		return turn{}, m.deferTask(ctx, t, retryAt, ErrParked, OutcomeParked, "turn", "in line")
	}
	t.booked, t.ahead = d.Slot, time.Until(d.At)
	m.metrics.parkedOn(r.Name, d, t.ahead)
	return turn{}, m.deferTask(ctx, t, retryAt, ErrParked, OutcomeParked,
		"turn", d.Turn, "booked_for", d.Slot.UTC(), "booked_ahead", t.ahead.Round(time.Millisecond))
}

// turn is how admit lets a task run: the Wait its handler sees, whether
// it holds a place of a concurrency rule (to release when the handler
// returns), and the permits it took, to settle (settle.go).
type turn struct {
	admission.Wait
	held bool
	res  *throttle.Reservation // the turn's permits; nil if none to settle
	cost int                   // the permits it took: the rule's Cost, an estimate
}

// taskRun is what admit knows of the task it decides for.
type taskRun struct {
	rule        *ruleGate
	task        *asynq.Task
	id          string
	subject     string
	cost        int
	lastAttempt bool
	byMaxWait   bool          // the wait in place was bounded by the rule's MaxWait, not the deadline
	booked      time.Time     // a parked task's turn (Redis clock); zero if it parked in its subject's line
	ahead       time.Duration // how far ahead booked was
	start       time.Time
	log         *slog.Logger
}

func (m *Middleware) newTaskRun(ctx context.Context, r *ruleGate, task *asynq.Task) *taskRun {
	id, _ := asynq.GetTaskID(ctx)
	return &taskRun{rule: r, task: task, id: id, start: time.Now(),
		log: m.log.With("rule", r.Name, "task_id", id, "task_type", task.Type())}
}

// archive returns the error that archives a task that can never run;
// noSubject says its subject was the reason.
func (t *taskRun) archive(ctx context.Context, msg string, noSubject bool, err error) error {
	err = &archivedError{rule: t.rule.Name, taskID: t.id, taskType: t.task.Type(), noSubject: noSubject, err: err}
	t.log.WarnContext(ctx, msg, "error", err)
	return err
}

// WakeOnHandoff returns a throttle.Options.OnHandoff that wakes the tasks
// a freed place of a concurrency rule was handed to, through the wake-up
// ledger in rdb (the asynq server's Redis, admission.WakeupsKey): the
// wake-up loop of any middleware with Options.Asynq moves them to pending
// at once. FromRules sets it on the limiters it builds (with Asynq); set it
// on limiters of your own that have a throttle.Concurrency rule.
func WakeOnHandoff(rdb redis.UniversalClient) func(waiters []string) {
	wakeups, _ := admission.NewWakeups(rdb, admission.WakeupsKey)
	return func(waiters []string) {
		ctx, cancel := context.WithTimeout(context.Background(), handoffTimeout)
		defer cancel()
		for _, w := range waiters {
			if err := wakeups.Add(ctx, w, time.UnixMicro(0)); err != nil {
				slog.Warn("worker: cannot wake a task handed a place of a concurrency rule; it comes back at its fallback", "member", w, "error", err)
			}
		}
	}
}

// handoffTimeout bounds WakeOnHandoff's writes.
const handoffTimeout = 5 * time.Second

// releaseTimeout bounds the release of a task's place.
const releaseTimeout = 5 * time.Second

// release gives back the place of a concurrency rule that a task of r ran
// under, whatever its handler returned.
func (m *Middleware) release(r *ruleGate, w admission.Wait) {
	ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	defer cancel()
	if err := r.gate.Limiter().Release(ctx, w.Subject); err != nil {
		m.log.Warn("worker: cannot release the task's place of a concurrency rule; it frees when its lease expires", "rule", w.Rule, "subject", w.Subject, "error", err)
	}
}

// parkAt records the task's wake-up and returns the RetryAt that parks it.
func (m *Middleware) parkAt(ctx context.Context, t *taskRun, bookID string, d admission.Decision) time.Time {
	if d.InLine {
		// Woken by the serving that books its turn; d.At is a fallback.
		return d.At
	}
	if m.wakeups != nil {
		queue, _ := asynq.GetQueueName(ctx)
		err := m.wakeups.Add(ctx, admission.Member(queue, bookID), d.Slot)
		if err == nil {
			// The wake-up loop brings it back just before its turn;
			// asynq's own schedule, the next whole second, is the fallback.
			return d.At
		}
		t.log.WarnContext(ctx, "worker: cannot record the wake-up; asynq's own schedule brings the task back", "error", err)
	}
	// Whole seconds, early: the task waits out the rest (earlyWaitUnwoken).
	return d.At.Add(-unwokenLead).Truncate(time.Second)
}

// sweepMember is the wake-up ledger's member for the sweep of a subject
// of a rule with a concurrency limit: an empty queue name, which no asynq
// task has.
func sweepMember(rule, subject string) string { return admission.Member("", rule, subject) }

// sweepLater makes sure a sweep of the subject of a task that parked
// waiting for a place of its rule's concurrency limit is due within a
// lease (d.Lease, the concurrency rule's). A place is handed to the next waiter when it is released, or
// when any call (a renewal of a live holder, a task's arrival) finds its
// lease expired; if every holder's worker died, nothing else would look.
// The sweep looks, once a lease while tasks wait, whatever their number.
func (m *Middleware) sweepLater(ctx context.Context, t *taskRun, d admission.Decision) {
	if m.wakeups == nil {
		return
	}
	redisNow := d.Slot.Add(-time.Until(d.At))
	if err := m.wakeups.AddIfAbsent(ctx, sweepMember(t.rule.Name, t.subject), redisNow.Add(d.Lease+admission.DefaultLead)); err != nil {
		t.log.WarnContext(ctx, "worker: cannot schedule the sweep of a concurrency limit; waiting tasks come back at their fallbacks", "error", err)
	}
}

// sweep brings the places of a rule's concurrency limit for subject up to
// date (expired leases handed to their waiters, who are woken through
// OnHandoff), and comes back when the earliest lease expires while tasks
// still wait.
func (m *Middleware) sweep(ctx context.Context, rule, subject string, passed int) error {
	member := sweepMember(rule, subject)
	r := m.ruleNamed(rule)
	if r == nil {
		// Another middleware's rule: one stacked in the same process
		// (mux.Use(a.Wrap, b.Wrap)), which shares the ledger, serves it;
		// failing that, it goes back to the ledger for another process
		// (a fleet with other rules on the same asynq Redis), counting
		// how often, so that the serving of a rule no process has any
		// more (removed, then the fleet restarted) is dropped after
		// maxPassed tries instead of going round for ever. A rule a
		// reload of this middleware removed is dropped at once.
		if other := sweepers.owner(m, rule); other != nil {
			return other.sweep(ctx, rule, subject, passed)
		}
		if _, gone := m.retired.Load(rule); gone || passed >= maxPassed {
			m.log.Debug("worker: dropped the serving of a rule no worker here has", "rule", rule, "passed", passed)
			return nil
		}
		return m.wakeups.Add(ctx, admission.Member("", rule, subject, strconv.Itoa(passed+1)), time.Now().Add(admission.DefaultLead+passAfter))
	}
	if r.gate == nil {
		return nil // a limiter that cannot book has no line nor places
	}
	if !r.leased {
		return m.serveLine(ctx, r, member, subject)
	}
	a, err := r.gate.Limiter().Admit(ctx, throttle.AdmitRequest{Subject: subject, N: 0, Waiter: "sweep", Tolerance: time.Second})
	if err != nil {
		return fmt.Errorf("worker: sweep of rule %q: %w", rule, err)
	}
	if a.Status != throttle.Booked || a.Lease == 0 {
		return nil // nobody waits (or the rule has no concurrency limit now)
	}
	// The loop takes a member DefaultLead before its slot: after the
	// expiry, then, not just before it.
	return m.wakeups.Add(ctx, member, a.Slot.Add(admission.DefaultLead+sweepMargin))
}

// serveLine serves the line of subject under rule r: the tasks whose
// turns it books are woken just before their slots, and the serving comes
// back when the line needs it again.
func (m *Middleware) serveLine(ctx context.Context, r *ruleGate, member, subject string) error {
	// The loop took the serving out of the ledger; if this process dies
	// before putting it back, another serves the line serveGuard later
	// instead of leaving it to the fallbacks of the tasks in it.
	if err := m.wakeups.Add(ctx, member, time.Now().Add(serveGuard)); err != nil {
		return fmt.Errorf("worker: serving the line of rule %q: %w: %w", r.Name, err, admission.ErrWakeLater)
	}
	s, err := r.gate.Serve(ctx, subject)
	if err != nil {
		if errors.Is(err, throttle.ErrRedis) {
			// Try again a tick later; the tasks in line have fallbacks.
			return fmt.Errorf("worker: serving the line of rule %q: %w: %w", r.Name, err, admission.ErrWakeLater)
		}
		return fmt.Errorf("worker: serving the line of rule %q: %w", r.Name, err)
	}
	m.metrics.lineServed(r.Name, s.Handed)
	wakes := s.Handed
	if !s.Next.IsZero() {
		if wakes == nil {
			wakes = map[string]time.Time{}
		}
		wakes[member] = s.Next.Add(admission.DefaultLead)
	}
	return m.wakeups.AddAll(ctx, wakes)
}

// A serving or sweep that a process without its rule takes goes back to
// the ledger passAfter later, at most maxPassed times (about 15s of tries,
// which a fleet sharing the ledger with others takes its own from long
// before).
const (
	passAfter = 300 * time.Millisecond
	maxPassed = 50
)

// serveGuard is how long after a serving of a line began another process
// serves it, if the first died before scheduling the next.
const serveGuard = 5 * time.Second

// sweepMargin puts a sweep after the lease it waits for has expired on the
// Redis clock.
const sweepMargin = 10 * time.Millisecond

// sweepers are the middlewares of this process that run a wake-up loop:
// a serving or sweep that one takes from the ledger for a rule it does not
// have is passed to the one that has it.
var sweepers = &sweeperSet{live: map[*Middleware]bool{}}

type sweeperSet struct {
	mu   sync.Mutex
	live map[*Middleware]bool
}

func (s *sweeperSet) add(m *Middleware) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live[m] = true
}

func (s *sweeperSet) remove(m *Middleware) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.live, m)
}

// owner returns another live middleware that has rule, or nil.
func (s *sweeperSet) owner(self *Middleware, rule string) *Middleware {
	s.mu.Lock()
	defer s.mu.Unlock()
	for m := range s.live {
		if m != self && m.ruleNamed(rule) != nil {
			return m
		}
	}
	return nil
}

// wakeLoop runs the wake-up ledger until Drain. Its errors are logged at
// most once per wakeErrorEvery (with how many there were), so that a Redis
// outage does not log one line per tick.
func (m *Middleware) wakeLoop() {
	defer close(m.stopped)
	defer sweepers.remove(m)
	var mu sync.Mutex // OnError is called from concurrent wakes
	var last time.Time
	var since int
	_ = m.wakeups.Run(m.drainCtx, admission.RunOptions{
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
func (m *Middleware) wake(ctx context.Context, member string) error {
	parts, ok := admission.Split(member)
	if ok && (len(parts) == 3 || len(parts) == 4) && parts[0] == "" {
		passed := 0 // times passed on by processes without the rule (sweep)
		if len(parts) == 4 {
			passed, _ = strconv.Atoi(parts[3])
		}
		return m.sweep(ctx, parts[1], parts[2], passed)
	}
	if !ok || len(parts) != 2 {
		return fmt.Errorf("worker: wake-up %q is not a queue and task ID", member)
	}
	queue, id := parts[0], parts[1]
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
func (m *Middleware) waitInPlace(ctx context.Context, t *taskRun) (admission.Wait, error) {
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
	err := r.Limiter.WaitN(wctx, t.subject, t.cost)
	m.metrics.waiting(r.Name, -1)
	if err != nil {
		return admission.Wait{}, m.notAdmitted(ctx, wctx, t, err)
	}
	w := admission.Wait{Rule: r.Name, Subject: t.subject, Duration: time.Since(t.start)}
	m.admitted(t, w)
	return w, nil
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
	outcome := OutcomeDeferred
	switch {
	case ctx.Err() != nil:
		// asynq ended the task: on shutdown it has already put the task
		// back in its queue; a new turn was refunded.
		m.metrics.decided(r.Name, OutcomeRefunded)
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
		outcome = OutcomeError
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
		m.metrics.decided(r.Name, OutcomeError)
		return t.archive(ctx, "worker: task archived: it can never be admitted", true, err)
	case errors.Is(err, throttle.ErrExceedsCapacity):
		m.metrics.decided(r.Name, OutcomeError)
		return t.archive(ctx, "worker: task archived: it can never be admitted", false, err)
	default:
		m.metrics.decided(r.Name, OutcomeError)
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
	level := slog.LevelDebug
	switch {
	case w.Redeemed:
		m.metrics.decided(rule, OutcomeRedeemed)
		attrs = append(attrs, "reason", "ran on the turn booked for it")
	case w.Duration < WaitThreshold:
		m.metrics.decided(rule, OutcomeAdmitted)
	default:
		m.metrics.decided(rule, OutcomeWaited)
		attrs = append(attrs, "reason", "its turn came within the rule's max_wait")
		if w.Duration >= time.Second {
			level = slog.LevelInfo
		}
	}
	t.log.Log(context.Background(), level, "worker: admitted", attrs...)
}

// deferTask returns the *admission.ThrottledError that defers the task to retryAt,
// requeueing a copy first if the task has no retry left. attrs are added
// to its log line.
func (m *Middleware) deferTask(ctx context.Context, t *taskRun, retryAt time.Time, cause error, outcome string, attrs ...any) error {
	rule := t.rule.Name
	te := &admission.ThrottledError{Rule: rule, Subject: t.subject, RetryAt: retryAt, Err: cause}
	if t.lastAttempt {
		if m.requeue == nil {
			m.metrics.decided(rule, OutcomeError)
			t.log.ErrorContext(ctx, "worker: task archived: throttled past its deadline on its last attempt; set worker.Options.Asynq to defer such tasks", "error", te)
			return te
		}
		copyID, err := m.requeue.copy(ctx, t.task, t.id, retryAt)
		if err != nil {
			m.metrics.decided(rule, OutcomeError)
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
	if outcome == OutcomeParked {
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
