// Package enqueue puts batches of asynq tasks in their queues, paced at
// the source: each task's slot is booked in the same Redis ledger the
// workers' throttle rules use (throttle.Limiter.PrepayN), the task is
// scheduled for that slot (asynq.ProcessAt) and carries the booking's
// receipt (admission.ReceiptHeader), which the worker middleware redeems
// instead of charging the rule again. The batch arrives paced; workers do
// not wait for permits and nothing is counted twice.
//
// Schedules run such batches on cron schedules (robfig/cron), with a
// policy for firings that overlap. cmd/enqueue is the command line.
//
// It owns the producer side: batches, schedules and the schedules file,
// and Pacer (one task at a time, for a web handler). It reads the workers'
// rules file with package rules and shares the header names and the
// wake-up ledger with them through package admission. Imports: asynq,
// robfig/cron, throttle, admission and rules; it must not import worker or
// handler, so a producer does not link the worker's middleware.
package enqueue

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Enqueuer is the part of *asynq.Client a batch needs.
type Enqueuer interface {
	EnqueueContext(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error)
}

var _ Enqueuer = (*asynq.Client)(nil)

// A Pacer books each task's slot in the workers' ledger.
type Pacer struct {
	// Limiter holds the workers' rule for the task type: same Redis, same
	// prefix, same rule names. Only token_bucket and gcra rules can book
	// ahead. Its MaxWait must be zero (or longer than the batch takes).
	Limiter *throttle.Limiter
	// Subject derives a task's subject from its payload as the workers do:
	// the rule's rules.SubjectConfig.Of, such as
	// rules.SubjectConfig{PayloadField: "account_id"}.Of. Required.
	Subject func(payload []byte) (string, error)
	// Cost derives a task's permits from its payload as the workers do
	// (the rule's rules.CostConfig.Of); if nil, one. A task of cost 0 is
	// enqueued unpaced: the workers run it without charging.
	Cost func(payload []byte) (int, error)
	// Costs, if set, derives a task's permits under each rule of the
	// Limiter, in the order of its rules, in place of Cost, as the
	// workers do (the rule's rules.RuleConfig.Costs: a policy whose
	// limits have costs of their own); the turn is booked at them
	// (throttle.Limiter.PrepayCosts). A task whose costs are all 0 is
	// enqueued unpaced.
	Costs func(payload []byte) (throttle.Costs, error)
	// Keep is how long a receipt outlives its slot, for a task that runs
	// late; a task later than that is charged again. If zero,
	// throttle's default, 24 hours, is used (Limiter.PrepayN).
	Keep time.Duration
	// Lead schedules each task this long before its slot. asynq keeps
	// ProcessAt in whole seconds (rounded down) and moves due tasks to
	// their queue every DelayedTaskCheckInterval, so a task scheduled for
	// its slot may reach a worker up to that interval late; with a Lead of
	// at least that interval it arrives early, and the worker middleware
	// holds it until its slot (the delay Admit reports for its receipt). The price is worker
	// slots: rate × (Lead + 1 s) tasks wait in handlers. If zero, tasks
	// are scheduled for their slot. Ignored with Wakeups.
	Lead time.Duration
	// Wakeups, if set, is the workers' wake-up ledger (on the asynq
	// Redis, at admission.WakeupsKey, with the workers' number of shards:
	// admission.NewShardedWakeups): each task is recorded there for its
	// slot, so that a worker with worker.Options.Asynq moves it to pending just
	// before the slot, and asynq's own schedule (the whole second after the
	// slot) is only a fallback. Tasks then start on their slots, spread over
	// each second, instead of together at its start.
	Wakeups *admission.Wakeups

	// check, if set (by PaceSpec.Pacer), runs once before the first
	// booking: admission.CheckLimits against the workers' published
	// limits. A Pacer built by hand can make that check itself.
	check     func(context.Context) error
	checkOnce sync.Once
	checkErr  error
}

// checkLimits runs p.check once and returns its error ever after.
func (p *Pacer) checkLimits(ctx context.Context) error {
	if p.check == nil {
		return nil
	}
	p.checkOnce.Do(func() { p.checkErr = p.check(ctx) })
	return p.checkErr
}

// Enqueue books task's slot, schedules it for that slot with its receipt
// (admission.ReceiptHeader) and enqueues it through c, with opts (do not set
// ProcessAt or ProcessIn): one call for a producer that enqueues a task
// at a time, such as a web handler. A task whose enqueueing fails gives
// its slot back. The task's own headers are kept.
func (p *Pacer) Enqueue(ctx context.Context, c Enqueuer, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	info, _, err := p.enqueue(ctx, c, task, opts)
	return info, err
}

// enqueue is Enqueue, also returning the slot (local time).
func (p *Pacer) enqueue(ctx context.Context, c Enqueuer, task *asynq.Task, opts []asynq.Option) (*asynq.TaskInfo, time.Time, error) {
	subject, n, err := p.terms(task.Payload())
	if err != nil {
		return nil, time.Time{}, err
	}
	if n == 0 {
		info, err := c.EnqueueContext(ctx, task, opts...)
		return info, time.Now(), err
	}
	if err := p.checkLimits(ctx); err != nil {
		return nil, time.Time{}, err
	}
	// Booking ahead is the point: ctx's deadline (a scheduler's
	// --run-for, say) must not bound how far ahead a slot may be.
	r, err := p.prepay(context.WithoutCancel(ctx), subject, n, task.Payload())
	if err != nil {
		return nil, time.Time{}, err
	}
	headers := maps.Clone(task.Headers())
	if headers == nil {
		headers = map[string]string{}
	}
	receipt, slot := r.Receipt()
	headers[admission.ReceiptHeader] = receipt
	if headers[admission.EnqueuedHeader] == "" { // a Batch stamps its tasks itself
		headers[admission.EnqueuedHeader] = strconv.FormatInt(time.Now().UnixMicro(), 10)
	}
	due := time.Now().Add(r.Delay())
	at := due.Add(-p.Lead)
	if p.Wakeups != nil {
		// asynq's schedule only as a fallback, after the wake-up.
		at = due.Add(time.Second)
	}
	opts = append(opts[:len(opts):len(opts)], asynq.ProcessAt(at))
	info, err := c.EnqueueContext(ctx, asynq.NewTaskWithHeaders(task.Type(), task.Payload(), headers), opts...)
	if err == nil && p.Wakeups != nil {
		// If this fails, the task is still enqueued and its fallback
		// schedule stands (see Wakeups).
		_ = p.Wakeups.Add(ctx, admission.JobEntry{Queue: info.Queue, ID: info.ID}.Member(), slot)
	}
	if err != nil {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = r.Cancel(cctx)
		return nil, time.Time{}, err
	}
	return info, due, nil
}

// terms returns the subject and the permits of a task whose payload is
// payload, as the Pacer books them, or the error a booking of them fails
// with at once whatever the ledger holds (Limiter.CheckN; a Pacer without
// a Limiter checks the subject and the cost only).
func (p *Pacer) terms(payload []byte) (subject string, n int, err error) {
	subject, err = p.Subject(payload)
	if err == nil && subject == "" {
		err = errors.New("the subject is empty")
	}
	if err != nil {
		return "", 0, fmt.Errorf("subject: %w", err)
	}
	if p.Costs != nil {
		return p.costTerms(subject, payload)
	}
	n = 1
	if p.Cost != nil {
		if n, err = p.Cost(payload); err != nil {
			return "", 0, fmt.Errorf("cost: %w", err)
		}
	}
	if p.Limiter != nil {
		if err := p.Limiter.CheckN(subject, n); err != nil {
			return "", 0, err
		}
	}
	return subject, n, nil
}

// costTerms is terms with Costs: n is the largest cost, 0 if every cost
// is (the task is enqueued unpaced).
func (p *Pacer) costTerms(subject string, payload []byte) (string, int, error) {
	c, err := p.Costs(payload)
	if err != nil {
		return "", 0, fmt.Errorf("cost: %w", err)
	}
	n := 0
	for _, x := range c {
		n = max(n, x)
	}
	if p.Limiter != nil {
		if err := p.Limiter.CheckCosts(subject, c); err != nil {
			return "", 0, err
		}
	}
	return subject, n, nil
}

// prepay books the turn of n permits (terms) for subject, with the costs
// per rule of payload if the Pacer has Costs.
func (p *Pacer) prepay(ctx context.Context, subject string, n int, payload []byte) (*throttle.Reservation, error) {
	if p.Costs == nil {
		return p.Limiter.PrepayN(ctx, subject, n, p.Keep)
	}
	c, err := p.Costs(payload)
	if err != nil {
		return nil, fmt.Errorf("cost: %w", err)
	}
	return p.Limiter.PrepayCosts(ctx, subject, c, p.Keep)
}

// MaxCount bounds the tasks of one batch (Batch.Count, the payloads of a
// file, a schedule's count): 10 million. A larger batch is most likely a
// mistake; split it.
const MaxCount = 10_000_000

// Batch is Count tasks of one type.
type Batch struct {
	Type string
	// Count is the number of tasks, at most MaxCount. If zero, one task
	// per payload.
	Count int
	// Payloads: none gives every task an empty payload, one gives every
	// task that payload, more give task i Payloads[i] (then Count must not
	// exceed their number).
	Payloads [][]byte
	// Where names payload i in errors, such as PayloadFile.Where
	// ("accounts.jsonl:12"). If nil, "payload i+1".
	Where func(i int) string
	// Pacer, if set, books a slot per task and schedules the task for it;
	// if nil, every task is due at once.
	Pacer *Pacer
	// MaxAhead, if positive, refuses a paced batch whose Plan books its
	// last slot further ahead than this: Run then enqueues nothing and
	// returns an *AheadError. If zero, there is no bound.
	MaxAhead time.Duration
	// Options are added to every task's (asynq.Queue, asynq.MaxRetry…).
	// Do not set ProcessAt or ProcessIn on a paced batch.
	Options []asynq.Option
	// OnPlan, if set, is called with the batch's Plan before its first
	// task is enqueued: say how far ahead it books.
	OnPlan func(Plan)
	// OnEnqueued, if set, is called after each task is enqueued.
	OnEnqueued func(Enqueued)
}

// Enqueued describes one enqueued task.
type Enqueued struct {
	Index int       // 0-based position in the batch
	Count int       // the batch's size
	ID    string    // asynq task ID
	Due   time.Time // when the task is due: its slot if paced, else now
	Paced bool
}

// Summary sums up a batch run.
type Summary struct {
	Enqueued int       // tasks enqueued, even when Run fails part way
	LastDue  time.Time // when the last enqueued task is due
}

// Validate reports a batch that cannot run, without calling Redis. For a
// paced batch it derives every task's subject and cost as the Pacer will
// and checks them against its limiter (throttle.Limiter.CheckN): a payload
// that would fail is a *PayloadError naming it, found before anything is
// enqueued.
func (b *Batch) Validate() error {
	if err := b.validateShape(); err != nil {
		return err
	}
	if b.Pacer != nil {
		_, err := b.scan()
		return err
	}
	return nil
}

// validateShape checks the batch's fields, not its payloads.
func (b *Batch) validateShape() error {
	switch {
	case b.Type == "":
		return errors.New("enqueue: the task type is empty")
	case b.Count < 0:
		return fmt.Errorf("enqueue: count %d is negative", b.Count)
	case b.Count == 0 && len(b.Payloads) == 0:
		return errors.New("enqueue: count is 0 and there are no payloads; give a count")
	case len(b.Payloads) > 1 && b.Count > len(b.Payloads):
		return fmt.Errorf("enqueue: count %d is more than the %d payloads", b.Count, len(b.Payloads))
	case b.size() > MaxCount:
		return fmt.Errorf("enqueue: %d tasks: a batch holds at most %d; split it", b.size(), MaxCount)
	case b.MaxAhead < 0:
		return fmt.Errorf("enqueue: MaxAhead %v is negative", b.MaxAhead)
	case b.Pacer != nil && (b.Pacer.Limiter == nil || b.Pacer.Subject == nil):
		return errors.New("enqueue: a Pacer needs a Limiter and a Subject")
	case b.Pacer != nil && b.Pacer.Lead < 0:
		return fmt.Errorf("enqueue: Pacer.Lead %v is negative", b.Pacer.Lead)
	}
	return nil
}

func (b *Batch) size() int {
	if b.Count == 0 {
		return len(b.Payloads)
	}
	return b.Count
}

func (b *Batch) payload(i int) []byte {
	switch len(b.Payloads) {
	case 0:
		return nil
	case 1:
		return b.Payloads[0]
	}
	return b.Payloads[i]
}

// Run enqueues the batch through c, in order. It first makes the batch's
// Plan, which checks every task as Validate does and, for a paced batch,
// reads how far ahead its busiest subject is booked: a payload that would
// fail, a batch beyond MaxAhead, or Redis failing then stop it before its
// first task. Then a paced task books its slot (one Redis round trip) and
// is cancelled (its permit refunded) if enqueueing it fails. Run stops at
// the first error, leaving the tasks already enqueued in place:
// Summary.Enqueued says how many. ctx's cancellation stops the batch
// between two tasks; its deadline does not bound how far ahead a paced
// task is booked (the Pacer's limiter MaxWait does, if set).
func (b *Batch) Run(ctx context.Context, c Enqueuer) (Summary, error) {
	var res Summary
	plan, err := b.Plan(ctx)
	if err != nil {
		return res, err
	}
	if b.MaxAhead > 0 && plan.Ahead > b.MaxAhead {
		return res, &AheadError{Plan: plan, MaxAhead: b.MaxAhead}
	}
	if b.OnPlan != nil {
		b.OnPlan(plan)
	}
	n := b.size()
	for i := range n {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		e, err := b.enqueue(ctx, c, i, n)
		if err != nil {
			return res, fmt.Errorf("enqueue: task %d of %d (%s): %w", i+1, n, b.Type, err)
		}
		res.Enqueued++
		if e.Due.After(res.LastDue) {
			res.LastDue = e.Due
		}
		if b.OnEnqueued != nil {
			b.OnEnqueued(e)
		}
	}
	return res, nil
}

func (b *Batch) enqueue(ctx context.Context, c Enqueuer, i, n int) (Enqueued, error) {
	e := Enqueued{Index: i, Count: n, Due: time.Now()}
	task := asynq.NewTaskWithHeaders(b.Type, b.payload(i), map[string]string{admission.EnqueuedHeader: strconv.FormatInt(e.Due.UnixMicro(), 10)})
	var info *asynq.TaskInfo
	var err error
	if b.Pacer != nil {
		info, e.Due, err = b.Pacer.enqueue(ctx, c, task, b.Options)
		e.Paced = info != nil
	} else {
		info, err = c.EnqueueContext(ctx, task, b.Options...)
	}
	if info != nil {
		e.ID = info.ID
	}
	return e, err
}
