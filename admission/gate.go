// Package admission decides, for a job that can leave and come back (a
// queued task), whether it runs now, waits a short while where it is, or
// parks until a turn booked for it in the shared ledger. It knows nothing
// of any queue: the asynq adapter (package worker) maps a task to a subject,
// a cost, an ID and a deadline, and maps a Park decision back to asynq's
// retry set and the wake-up ledger (Wakeups).
//
// It also owns what producers, workers and handlers must agree on, so
// that none of them needs another's package: the task headers and the
// wake-up key (protocol.go), and how a job says "come back later, this is
// not a failure" (ThrottledError) and learns how it was admitted
// (WaitedFrom).
//
// Imports: throttle and go-redis only; it must not import asynq, rules,
// worker, enqueue or handler.
//
//	gate, err := admission.New(lim, admission.Options{MaxWait: time.Second})
//	d, err := gate.Admit(ctx, admission.Request{Subject: "acct-42", ID: taskID})
//	switch {
//	case err != nil:
//		return err // Redis failed, ctx ended, or the turn is past ctx's deadline
//	case d.Outcome == admission.Park:
//		return reschedule(d.At) // come back then: the turn is booked under taskID
//	}
//	run()
//
// A turn is booked once. A job that comes back early waits for it in place
// (up to Options.EarlyWait); one that comes back later than the tolerance
// takes a new turn, so a fleet that was stopped does not start its overdue
// work all at once.
package admission

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Defaults of Options.
const (
	// DefaultMaxWait is how long a job waits where it is for a new turn
	// when Options.MaxWait is zero.
	DefaultMaxWait = time.Second
	// DefaultWaitSlots is how many jobs of one subject may wait in one
	// process for a new turn when Options.WaitSlots is zero.
	DefaultWaitSlots = 2
	// DefaultEarlyWait is how long a job back early for its booked turn
	// waits for it in place, whatever the waiting slots, when
	// Options.EarlyWait is zero.
	DefaultEarlyWait = 500 * time.Millisecond
)

// Options tune a Gate. The zero value uses every default.
type Options struct {
	// MaxWait is the longest a job waits where it is (holding, say, a
	// worker slot) for a new turn; a later turn is booked and the job
	// parks. If zero, DefaultMaxWait; it never exceeds the context's
	// deadline.
	MaxWait time.Duration
	// WaitSlots bounds how many jobs of one subject wait in this process
	// for a new turn, so that a subject over its limit cannot
	// fill every worker slot with waiting jobs: the others park at once.
	// If zero, DefaultWaitSlots.
	WaitSlots int
	// EarlyWait is how long a job that comes back early for its booked
	// turn waits for it in place (a queue that schedules in whole seconds,
	// or a wake-up sent ahead of the slot), whatever the waiting slots. If
	// zero, DefaultEarlyWait. A new turn is waited for only in a waiting
	// slot (MaxWait, WaitSlots).
	EarlyWait time.Duration
	// Shared, if set, also bounds the jobs waiting for a new turn across
	// every gate that shares it (all rules, all subjects): with
	// many hot subjects, WaitSlots each could still fill the worker slots.
	// If nil, only WaitSlots bounds them.
	Shared *Slots
	// Tolerance is how late a job may come back for its booked turn and
	// still take it; a later one takes a new turn. If zero, the limiter's
	// default (throttle.AdmitRequest.Tolerance): the interval of its
	// tightest rule (period / count), at least 1ms and at most 1s: a start
	// late by up to one interval keeps the starts of any
	// window within limit + burst. A larger tolerance lets a loaded worker
	// whose jobs come back late keep more of their turns, at the price of
	// the turns of one tolerance more in a window.
	Tolerance time.Duration
}

// Gate admits jobs under one throttle.Limiter. It is safe for concurrent
// use.
type Gate struct {
	lim  *throttle.Limiter
	opts Options

	mu      sync.Mutex
	waiting map[string]int // jobs holding a waiting slot, by subject
}

// New returns a Gate over lim. It returns an error naming the field if a
// field of opts is negative.
func New(lim *throttle.Limiter, opts Options) (*Gate, error) {
	if lim == nil {
		return nil, errors.New("admission: nil limiter")
	}
	switch {
	case opts.MaxWait < 0:
		return nil, fmt.Errorf("admission: max_wait %v must not be negative", opts.MaxWait)
	case opts.WaitSlots < 0:
		return nil, fmt.Errorf("admission: wait_slots %d must not be negative", opts.WaitSlots)
	case opts.EarlyWait < 0:
		return nil, fmt.Errorf("admission: early_wait %v must not be negative", opts.EarlyWait)
	case opts.Tolerance < 0:
		return nil, fmt.Errorf("admission: tolerance %v must not be negative", opts.Tolerance)
	}
	if opts.MaxWait == 0 {
		opts.MaxWait = DefaultMaxWait
	}
	if opts.WaitSlots == 0 {
		opts.WaitSlots = DefaultWaitSlots
	}
	if opts.EarlyWait == 0 {
		opts.EarlyWait = DefaultEarlyWait
	}
	return &Gate{lim: lim, opts: opts, waiting: map[string]int{}}, nil
}

// Options returns the gate's options, defaults filled in.
func (g *Gate) Options() Options { return g.opts }

// Limiter returns the limiter the gate admits under.
func (g *Gate) Limiter() *throttle.Limiter { return g.lim }

// Request is a job asking to run.
type Request struct {
	// Subject is what the limiter limits. Required.
	Subject string
	// Cost is the number of permits the job takes; if zero, 1.
	Cost int
	// ID is the job's identity across its arrivals (a task ID): its
	// booked turn is kept under it. If empty, the job cannot park, and a
	// turn later than it can wait fails with a *throttle.DelayError.
	ID string
	// Receipt is a receipt from throttle.Limiter.PrepayN that the job
	// carries (booked by its producer), or empty.
	Receipt string
	// BookAs, if not empty, is the ID the job will come back under, if not
	// ID (a task requeued as a copy): a new turn is booked under it.
	BookAs string
}

// Outcome is what a job does after Admit.
type Outcome int

const (
	// Run: the job's turn has come; run it now.
	Run Outcome = iota + 1
	// Park: the job's turn is booked for Decision.At; leave, and come back
	// then with the same ID.
	Park
)

// String returns "run" or "park".
func (o Outcome) String() string {
	switch o {
	case Run:
		return "run"
	case Park:
		return "park"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Decision is Admit's answer.
type Decision struct {
	Outcome Outcome
	// Turn says how the turn was found: throttle.Granted (a new turn, now
	// or after waiting), throttle.Redeemed (one booked earlier, by this job
	// or its producer), throttle.Booked (a new turn, booked: parked), or
	// throttle.Held (one booked earlier, still ahead: parked).
	Turn throttle.AdmitStatus
	// Rule is the limiter rule that set a new turn; empty for a booked one.
	Rule string
	// At is, for Run, when the job was admitted, and for Park, when its
	// turn comes (local clock).
	At time.Time
	// Slot is the turn on the Redis clock (for Park: schedule the wake-up
	// by it, as Wakeups.Add does).
	Slot time.Time
	// Waited is how long Admit kept the job.
	Waited time.Duration
}

// Admit decides for req: run (now, after waiting in one of the subject's
// WaitSlots for a new turn at most MaxWait away, or after waiting at most
// EarlyWait for a booked turn it came back early for) or park until the
// booked turn. It waits no longer than ctx's deadline.
//
// It returns ctx.Err() if ctx ends while the job waits (a new turn's
// permits are refunded; a redeemed booking is spent), an error matching
// throttle.ErrRedis if Redis fails, a *throttle.DelayError if the job has
// no ID and its turn is later than it can wait, and the limiter's error for
// a bad subject or a cost beyond its capacity.
func (g *Gate) Admit(ctx context.Context, req Request) (Decision, error) {
	start := time.Now()
	if err := ctx.Err(); err != nil {
		return Decision{}, err
	}
	cost := req.Cost
	if cost == 0 {
		cost = 1
	}
	// A new turn is waited for only in one of the subject's waiting slots:
	// without one, a job whose turn is not now parks, however close the
	// turn, so that a subject over its limit cannot keep every worker slot
	// cycling through its own jobs while others queue behind them. A job
	// back for a turn it already has may wait EarlyWait for it.
	wait, early := time.Duration(0), g.opts.EarlyWait
	if g.takeSlot(req.Subject) {
		defer g.releaseSlot(req.Subject)
		wait = g.opts.MaxWait
		early = max(early, wait)
	}
	byDeadline := false
	if dl, ok := ctx.Deadline(); ok {
		// Less the slack: the turn is mapped from the Redis clock onto
		// ours, so a turn granted right at the bound can land just past
		// it, and the job would give back a turn it was granted.
		left := max(dl.Sub(start)-wakeSlack, 0)
		if left < wait {
			wait, byDeadline = left, true
		}
		early = min(early, left)
	}
	a, err := g.lim.Admit(ctx, throttle.AdmitRequest{
		Subject: req.Subject, N: cost, ID: req.ID, Receipt: req.Receipt, BookAs: req.BookAs,
		Wait: wait, EarlyWait: max(early, time.Microsecond), Tolerance: g.opts.Tolerance,
	})
	if err != nil {
		return Decision{}, err
	}
	d := Decision{Turn: a.Status, Rule: a.Rule, At: a.At, Slot: a.Slot}
	switch a.Status {
	case throttle.Booked, throttle.Held:
		d.Outcome = Park
	case throttle.Granted, throttle.Redeemed:
		if err := sleepUntil(ctx, a.At); err != nil {
			if a.Reservation != nil {
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refundTimeout)
				_ = a.Reservation.Cancel(rctx)
				cancel()
			}
			return Decision{}, err
		}
		d.Outcome, d.At = Run, time.Now()
	default: // throttle.Denied: no ID to book under
		return Decision{}, &throttle.DelayError{Rule: a.Rule, RetryAfter: a.Delay, Deadline: byDeadline}
	}
	d.Waited = time.Since(start)
	return d, nil
}

// refundTimeout bounds the refund of a turn whose wait ended with its
// context.
const refundTimeout = 2 * time.Second

// wakeSlack is kept between a granted turn and the context's deadline:
// more than the error of mapping a turn from the Redis clock onto the
// local one (a round trip, on a busy machine).
const wakeSlack = 25 * time.Millisecond

// takeSlot takes one of subject's waiting slots (and one of the shared
// ones), and reports whether one was free.
func (g *Gate) takeSlot(subject string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.waiting[subject] >= g.opts.WaitSlots || !g.opts.Shared.take() {
		return false
	}
	g.waiting[subject]++
	return true
}

func (g *Gate) releaseSlot(subject string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.opts.Shared.release()
	if g.waiting[subject]--; g.waiting[subject] <= 0 {
		delete(g.waiting, subject)
	}
}

// Slots is a bound on waiting jobs shared by several gates (Options.Shared):
// at most n of their jobs hold a waiting slot at once. A nil *Slots
// bounds nothing. It is safe for concurrent use.
type Slots struct {
	mu   sync.Mutex
	n    int
	used int
}

// NewSlots returns a bound of n waiting jobs; n < 1 is taken as 1.
func NewSlots(n int) *Slots { return &Slots{n: max(n, 1)} }

func (s *Slots) take() bool {
	if s == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used >= s.n {
		return false
	}
	s.used++
	return true
}

func (s *Slots) release() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.used--
}

// sleepUntil waits until t or until ctx ends, whose error it returns then.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
