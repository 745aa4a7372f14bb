// Package enqueue puts batches of asynq tasks in their queues, paced at
// the source: each task's slot is booked in the same Redis ledger the
// workers' throttle rules use (throttle.Limiter.PrepayN), the task is
// scheduled for that slot (asynq.ProcessAt) and carries the booking's
// receipt (worker.ReceiptHeader), which the worker middleware redeems
// instead of charging the rule again. The batch arrives paced; workers do
// not wait for permits and nothing is counted twice.
//
// Schedules run such batches on cron schedules (robfig/cron), with a
// policy for firings that overlap. cmd/enqueue is the command line.
package enqueue

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
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
	// Subject derives a task's subject as the workers do.
	Subject worker.Subject
	// Keep is how long a receipt outlives its slot, for a task that runs
	// late; a task later than that is charged again. If zero,
	// throttle.DefaultReceiptKeep is used.
	Keep time.Duration
	// Lead schedules each task this long before its slot. asynq keeps
	// ProcessAt in whole seconds (rounded down) and moves due tasks to
	// their queue every DelayedTaskCheckInterval, so a task scheduled for
	// its slot may reach a worker up to that interval late; with a Lead of
	// at least that interval it arrives early, and the worker middleware
	// holds it until its slot (Limiter.Redeem's delay). The price is worker
	// slots: rate × (Lead + 1 s) tasks wait in handlers. If zero, tasks
	// are scheduled for their slot.
	Lead time.Duration
}

// Batch is Count tasks of one type.
type Batch struct {
	Type string
	// Count is the number of tasks. If zero, one task per payload.
	Count int
	// Payloads: none gives every task an empty payload, one gives every
	// task that payload, more give task i Payloads[i] (then Count must not
	// exceed their number).
	Payloads [][]byte
	// Pacer, if set, books a slot per task and schedules the task for it;
	// if nil, every task is due at once.
	Pacer *Pacer
	// Options are added to every task's (asynq.Queue, asynq.MaxRetry…).
	// Do not set ProcessAt or ProcessIn on a paced batch.
	Options []asynq.Option
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

// Result sums up a batch run.
type Result struct {
	Enqueued int       // tasks enqueued, even when Run fails part way
	LastDue  time.Time // when the last enqueued task is due
}

// Validate reports a batch that cannot run.
func (b *Batch) Validate() error {
	switch {
	case b.Type == "":
		return errors.New("enqueue: the task type is empty")
	case b.Count < 0:
		return fmt.Errorf("enqueue: count %d is negative", b.Count)
	case b.Count == 0 && len(b.Payloads) == 0:
		return errors.New("enqueue: count is 0 and there are no payloads; give a count")
	case len(b.Payloads) > 1 && b.Count > len(b.Payloads):
		return fmt.Errorf("enqueue: count %d is more than the %d payloads", b.Count, len(b.Payloads))
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

// Run enqueues the batch through c, in order. A paced task books its slot
// first (one Redis round trip) and is cancelled (its permit refunded) if
// enqueueing it fails. Run stops at the first error, leaving the tasks
// already enqueued in place: Result.Enqueued says how many. ctx's
// cancellation stops the batch between two tasks; its deadline does not
// bound how far ahead a paced task is booked (the Pacer's limiter MaxWait
// does, if set).
func (b *Batch) Run(ctx context.Context, c Enqueuer) (Result, error) {
	var res Result
	if err := b.Validate(); err != nil {
		return res, err
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
	payload := b.payload(i)
	e := Enqueued{Index: i, Count: n, Due: time.Now()}
	opts := b.Options
	var headers map[string]string
	var r *throttle.Reservation
	if p := b.Pacer; p != nil {
		subject, err := p.Subject(asynq.NewTask(b.Type, payload))
		if err == nil && subject == "" {
			err = errors.New("the subject is empty")
		}
		if err != nil {
			return e, fmt.Errorf("subject: %w", err)
		}
		// Booking ahead is the point: ctx's deadline (a scheduler's
		// --run-for, say) must not bound how far ahead a slot may be.
		if r, err = p.Limiter.PrepayN(context.WithoutCancel(ctx), subject, 1, p.Keep); err != nil {
			return e, err
		}
		headers = map[string]string{worker.ReceiptHeader: r.Receipt()}
		e.Due, e.Paced = r.TimeToAct(), true
		opts = append(opts[:len(opts):len(opts)], asynq.ProcessAt(e.Due.Add(-p.Lead)))
	}
	info, err := c.EnqueueContext(ctx, asynq.NewTaskWithHeaders(b.Type, payload, headers), opts...)
	if err != nil {
		if r != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = r.Cancel(cctx)
		}
		return e, err
	}
	e.ID = info.ID
	return e, nil
}
