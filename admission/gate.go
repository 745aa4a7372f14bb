// Package admission decides, for a job that can leave and come back (a
// queued task), whether it runs now, waits a short while where it is, or
// parks until a turn booked for it in the shared ledger. It knows nothing
// of any queue: the asynq adapter (package worker) maps a task to a subject,
// a cost, an ID and a deadline, and a decision back to asynq (run the
// handler, or its retry set until the turn).
//
// It also owns parking and waking: a gate given a Parking (Options.Parking)
// records the wake-ups of the jobs it parks in the shared ledger
// (Wakeups), and Parking.Run takes each due entry (ledger.go: a JobEntry or
// a LineEntry): it serves a subject's line, or sweeps its places, itself,
// and hands a parked job to the adapter's wake function, the one thing a
// queue must supply (for asynq, move the task to pending).
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
//	gate, err := admission.New(lim, admission.Options{Settings: admission.Settings{MaxWait: time.Second}})
//	d, err := gate.Admit(ctx, admission.Request{Subject: "acct-42", Caller: throttle.Caller{ID: taskID}})
//	switch {
//	case err != nil:
//		return err // Redis failed, ctx ended, or the turn is past ctx's deadline
//	case d.Outcome == admission.Park:
//		if !d.Serve.IsZero() {
//			scheduleServe(d.Serve) // this job started the subject's line
//		}
//		return reschedule(d.At) // come back then (or when Serve hands it a turn)
//	}
//	run()
//
//	// and, when scheduleServe says:
//	s, err := gate.Serve(ctx, "acct-42")
//	wakeAt(s.Handed)     // each job in line just booked, with its slot
//	scheduleServe(s.Next) // if not zero
//
// A job whose turn would be more than Options.Horizon ahead (1s by
// default) waits in the subject's line in Redis, booked nothing, until a
// serving of the line books its turn; so a deep backlog books a second of
// turns, not all of them, and a limit that changes applies within about a
// second. Request.Share divides the line among tenants. With a Parking
// (and no ShareLimit) the line's members serve it: its head is woken for
// its turn, and its Admit books that turn and those after it within the
// horizon and names the next head (Decision.Head), in its one call; a
// Parking serves a line itself only when asked (Decision.Serve without a
// Head: a line whose head never came back).
//
// A turn is booked once. A job that comes back early waits for it in place
// (up to Options.EarlyWait); one that comes back later than the tolerance
// takes a new turn, so a fleet that was stopped does not start its overdue
// work all at once.
package admission

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Defaults of Options (and of its Settings).
const (
	// DefaultMaxWait is how long a job waits where it is for a new turn
	// when Settings.MaxWait is zero.
	DefaultMaxWait = time.Second
	// DefaultWaitSlots is how many jobs of one subject may wait in one
	// process for a new turn when Settings.WaitSlots is zero.
	DefaultWaitSlots = 2
	// DefaultEarlyWait is how long a job back early for its booked turn
	// waits for it in place, whatever the waiting slots, when
	// Options.EarlyWait is zero.
	DefaultEarlyWait = 500 * time.Millisecond
	// DefaultHorizon is how far ahead a parked job's turn may be booked
	// when Settings.Horizon is zero.
	DefaultHorizon = time.Second
	// DefaultMaxAge is, in horizons, how long a job with a Priority waits
	// in its subject's line for younger jobs of higher levels when
	// Settings.MaxAge is zero (throttle.AdmitRequest.MaxAge's default, the
	// same number): a minute at DefaultHorizon. The worker gives a rule
	// with a priority this MaxAge, for its jobs of level 0 too.
	DefaultMaxAge = 60
)

// Options tune a Gate. The zero value uses every default.
type Options struct {
	// Settings are the rule's: MaxWait, WaitSlots, Horizon, Weights and
	// ShareLimit (see Settings for each, and its defaults).
	Settings
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
	// Parking, if set, is where the gate records the wake-ups of the jobs
	// it parks (the job at its slot, its subject's line at Decision.Serve,
	// the sweep of its places within a lease), and which serves its line
	// once Parking.Serve is given the gate. If nil, a parked job comes back
	// by its queue's own schedule, and nobody serves a line: give a
	// negative Horizon.
	Parking *Parking
	// Name names the gate in the ledger's line entries (LineEntry.Rule):
	// every process must give the same name to the gates of the same
	// limiter, and Parking.Serve routes a line's serving by it. Required
	// with Parking.
	Name string
}

// Gate admits jobs under one throttle.Limiter. It is safe for concurrent
// use.
type Gate struct {
	lim  *throttle.Limiter
	opts Options

	// leased: the limiter has a Concurrency rule, so a job that runs holds
	// a place, and the gate has places to sweep instead of a line.
	leased bool

	mu      sync.Mutex
	waiting map[string]int // jobs holding a waiting slot, by subject
}

// New returns a Gate over lim. It returns an error naming the field if a
// field of opts is negative, or out of range (Settings.Check: a
// *SettingsError).
func New(lim *throttle.Limiter, opts Options) (*Gate, error) {
	if lim == nil {
		return nil, errors.New("admission: nil limiter")
	}
	if err := opts.Check(lim.Rules()...); err != nil {
		return nil, err
	}
	switch {
	case opts.EarlyWait < 0:
		return nil, fmt.Errorf("admission: early_wait %v must not be negative", opts.EarlyWait)
	case opts.Tolerance < 0:
		return nil, fmt.Errorf("admission: tolerance %v must not be negative", opts.Tolerance)
	}
	if opts.ShareLimit != (throttle.Limit{}) && opts.Horizon < 0 {
		return nil, errors.New("admission: a share limit needs the subject's line: horizon must not be negative")
	}
	if opts.Parking != nil && opts.Name == "" {
		return nil, errors.New("admission: a gate with a parking needs a name, the same in every process, for its line's servings")
	}
	opts.Settings = opts.withDefaults()
	if opts.EarlyWait == 0 {
		opts.EarlyWait = DefaultEarlyWait
	}
	leased := slices.ContainsFunc(lim.Rules(), func(r throttle.Rule) bool { return r.Algorithm == throttle.Concurrency })
	return &Gate{lim: lim, opts: opts, leased: leased, waiting: map[string]int{}}, nil
}

// Leased reports whether the gate's limiter has a Concurrency rule: a job
// it lets run holds a place (Decision.Place) until it releases it.
func (g *Gate) Leased() bool { return g.leased }

// Acquire waits for n permits of subject as the limiter's Acquire does,
// until ctx ends, whatever the gate's options: for a job that cannot park
// (it could not come back), which waits where it is as long as ctx
// allows. With a Concurrency rule the job then holds the place it returns
// (nil without one): give it back with its Release when the job ends.
func (g *Gate) Acquire(ctx context.Context, subject string, n int) (*throttle.Place, error) {
	return g.lim.Acquire(ctx, subject, n)
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
	// Costs, if not nil, is what the job takes under each rule of the
	// gate's limiter, in the order of its rules (throttle.Costs: an LLM
	// call's requests, input and output tokens), in place of Cost; a rule
	// of cost 0 does not delay it.
	Costs throttle.Costs
	// Caller is who the job is to the limiter (throttle.Caller), as Admit
	// passes it on:
	//   - ID is the job's identity across its arrivals (a task ID): its
	//     booked turn is kept under it. If empty, the job cannot park, and
	//     a turn later than it can wait fails with a *throttle.DelayError.
	//   - Receipt is a receipt from throttle.Limiter.PrepayN that the job
	//     carries (booked by its producer), or empty.
	//   - BookAs, if not empty, is the ID the job will come back under, if
	//     not ID (a task requeued as a copy): a new turn is booked under it.
	//   - Waiter is the job under the limiter's Concurrency rule, if it has
	//     one: what the limiter's OnHandoff is given to wake the job when a
	//     place is handed to it. If empty, ID. A job that runs holds a
	//     place until it ends (Decision.Place).
	//   - WaitAs, if not empty, is the Waiter the job comes back as, if not
	//     Waiter (a task requeued as a copy): it takes over Waiter's place,
	//     or its position in the queue for one.
	//     In the subject's line (Options.Horizon), the job is named by
	//     WaitAs, Waiter, BookAs or ID, the first set: Gate.Serve hands that
	//     name its turn. With Options.Parking, that name is also the job's
	//     wake-up in the ledger, and a Waiter is woken by Parking.Run when a
	//     place is handed to it (WakeOnHandoff): give each a JobEntry's
	//     Member.
	//   - Share is the job's share of its subject's line (a tenant of one
	//     API key): the shares with jobs in line are served in turn, each by
	//     its Weight, from 1 to MaxWeight; if zero, the share's weight in
	//     Options.Weights (1 if absent). Empty is a share like any other.
	//   - Priority is the job's level in its subject's line, 0 to
	//     MaxPriority: higher levels are served first, within a
	//     level the shares in turn; Settings.MaxAge bounds how long a job
	//     waits for younger higher ones. A turn already booked is kept.
	throttle.Caller
	// BookAhead books a new turn however far ahead, past Options.Horizon,
	// and never puts the job in the line: for a job that must hold turns
	// of several gates in turn, which the back of one gate's line would
	// make lose the other's turn each time it came back.
	BookAhead bool
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

// Decision is Admit's answer: the limiter's answer (throttle.Admission,
// embedded: Status, Rule, At, Slot, Reservation, Place, Lease, InLine,
// Serve…, each documented there) and what the gate made of it. Two of the
// limiter's fields read differently here: At is, for Run, when the job was
// admitted (after its wait), and Reservation is nil for Park. Status is
// Granted or Redeemed for Run, Booked or Held for Park (Label and Reason
// say what the worker calls each; admission/status.go has the table of
// statuses from Redis up); Handed, Waiting and Head, which only a serving
// of the line sets, are the serving's that the job's return made, with
// Options.Parking (throttle.AdmitRequest.HeadServes), and Admit recorded
// its wake-ups.
type Decision struct {
	// Outcome is what the job does: Run or Park.
	Outcome Outcome
	throttle.Admission
	// Due is, for Run, when its turn came on the local clock (At is that
	// or later: a busy machine wakes late).
	Due time.Time
	// Waited is how long Admit kept the job.
	Waited time.Duration
	// Woken, for Park, is true when the job will be woken for its turn
	// through Options.Parking: its wake-up is in the ledger, or (InLine)
	// the serving that books its turn will record it (or the job ahead
	// of it in line, whose return serves the line). False without a
	// Parking, or if the ledger could not be written (ParkErr): the job
	// then comes back by its queue's own schedule, for At.
	Woken bool
	// ParkErr, for Park, says which wake-ups Admit could not record in
	// Options.Parking (Redis failed); the decision stands. For Run, the
	// same of the jobs its call booked in its subject's line (they come
	// back at their fallbacks). Nil otherwise.
	ParkErr error
}

// Admit decides for req: run (now, after waiting in one of the subject's
// WaitSlots for a new turn at most MaxWait away, or after waiting at most
// EarlyWait for a booked turn it came back early for) or park until the
// booked turn. It waits no longer than ctx's deadline.
//
// It returns ctx.Err() if ctx ends while the job waits (a new turn's
// permits are refunded; a redeemed booking is booked again under the
// job's ID, for when it comes back), an error matching
// throttle.ErrRedis if Redis fails, a *throttle.DelayError if the job has
// no ID and its turn is later than it can wait, and the limiter's error for
// a bad subject or a cost beyond its capacity.
func (g *Gate) Admit(ctx context.Context, req Request) (Decision, error) {
	return g.admit(ctx, req, -1)
}

// admit is Admit, with the wait for a turn (new or booked) at most bound,
// if bound is not negative: a later turn parks the job (Stack).
func (g *Gate) admit(ctx context.Context, req Request, bound time.Duration) (Decision, error) {
	start := time.Now()
	if err := ctx.Err(); err != nil {
		return Decision{}, err
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
	if bound >= 0 {
		wait, early = min(wait, bound), min(early, bound)
	}
	a, err := g.lim.Admit(ctx, g.limiterRequest(req, wait, early))
	if err != nil {
		return Decision{}, err
	}
	d := Decision{Admission: a}
	d.Outcome = d.row().outcome // status.go
	if g.opts.Parking != nil && (d.Outcome == Park || d.Handed != nil || !d.Serve.IsZero() || d.Waiting > 0) {
		// Before a Run's wait: the jobs its call booked in its line are
		// woken on time, whatever becomes of it.
		d.Woken, d.ParkErr = g.opts.Parking.park(ctx, g.opts.Name, req, d)
	}
	switch d.Outcome {
	case Park:
		d.Reservation = nil
	case Run:
		if err := sleepUntil(ctx, a.At); err != nil {
			g.leave(ctx, a)
			return Decision{}, err
		}
		d.At, d.Due = time.Now(), a.At
	default: // throttle.Denied: no ID to book under
		return Decision{}, &throttle.DelayError{Rule: a.Rule, RetryAfter: a.Delay, Deadline: byDeadline}
	}
	d.Waited = time.Since(start)
	return d, nil
}

// leave gives back what a job whose wait for its turn a ended (ctx) holds:
// a new turn is refunded; a redeemed one, not yet due, is booked again
// under the job's ID (throttle.Reservation.Rebook), so that the job, put
// back in its queue (a worker draining for shutdown), runs on that same
// turn when it comes back instead of taking a new one and leaving this
// one unused. (A refund would not do: under a backlog, later turns hold
// the refunded one's place, and the rules get it back only when they are
// cancelled too.) A job that never comes back leaves it unused, as a
// spent turn would be; its place, if any, is released.
func (g *Gate) leave(ctx context.Context, a throttle.Admission) {
	rctx, cancel := g.lim.Detach(ctx) // a refund lost is reported (OnRedisError)
	defer cancel()
	switch {
	case a.Reservation == nil:
	case a.Status == throttle.Redeemed:
		_, _ = a.Reservation.Rebook(rctx)
	default:
		_ = a.Reservation.Cancel(rctx)
	}
	_ = a.Place.Release(rctx) // nil without a place: nothing
}

// limiterRequest is req as the limiter takes it, under the gate's
// options: the one place a Request becomes a throttle.AdmitRequest. wait
// is how long the job may wait for a new turn, early for a booked one.
func (g *Gate) limiterRequest(req Request, wait, early time.Duration) throttle.AdmitRequest {
	horizon := max(g.opts.Horizon, 0)
	if req.BookAhead && g.opts.ShareLimit == (throttle.Limit{}) {
		// (A share limit is kept in the line: such a gate always uses it.)
		horizon = 0
	}
	n := req.Cost
	if n == 0 {
		n = 1
	}
	if req.Weight == 0 {
		req.Weight = g.opts.Weights[req.Share]
	}
	if req.Costs != nil {
		n = 0 // throttle.AdmitRequest: N or Costs
	}
	return throttle.AdmitRequest{
		Subject: req.Subject, N: n, Costs: req.Costs, Caller: req.Caller,
		Wait: wait, EarlyWait: max(early, time.Microsecond), Tolerance: g.opts.Tolerance,
		Horizon: horizon, ShareLimit: g.opts.ShareLimit, MaxAge: g.opts.MaxAge,
		// With a Parking, each member of the line is woken by the ledger,
		// and so can serve it: no serving, nor its guard, per member.
		HeadServes: g.opts.Parking != nil,
	}
}

// name is the job's name in its subject's line and under a Concurrency
// rule (Request.WaitAs): the first of WaitAs, Waiter, BookAs and ID set.
func (r Request) name() string { return cmp.Or(r.WaitAs, r.Waiter, r.BookAs, r.ID) }

// Served is what one serving of a subject's line did (Gate.Serve).
type Served struct {
	// Handed are the jobs of the line just booked, by name (see
	// Request.WaitAs), each with its slot on the Redis clock: wake each
	// shortly before its slot.
	Handed map[string]time.Time
	// Next, if not zero, is when to serve the line again (Redis clock):
	// jobs still wait in it.
	Next time.Time
	// Waiting is how many jobs still wait in the line after the serving:
	// the line's length, 0 once it is empty (throttle.LineServing.Waiting).
	Waiting int
}

// Serve books the turns of the jobs at the head of subject's line that
// fall within the horizon, in order (a share at a time, by weight), and
// says when to serve it next. One process should serve a subject's line
// at a time, when the last serving (or a Decision.Serve) said; serving it
// more often is harmless and books nothing new. It costs one script call
// for up to 256 jobs. Without a line (a negative Horizon), it returns an
// empty Served; a limiter with a Concurrency rule has no line either, and
// Serve then sweeps its places as Admit with N = 0 does (handing expired
// leases' places on through OnHandoff) and returns an empty Served.
func (g *Gate) Serve(ctx context.Context, subject string) (Served, error) {
	if g.opts.Horizon < 0 {
		return Served{}, nil
	}
	ls, err := g.lim.ServeLine(ctx, subject, g.opts.Horizon, g.opts.ShareLimit)
	if err != nil {
		return Served{}, err
	}
	return Served{Handed: ls.Handed, Next: ls.Next, Waiting: ls.Waiting}, nil
}

// sweep brings subject's places of the limiter's Concurrency rule up to
// date (expired leases' places handed to their waiters through the
// limiter's OnHandoff), and returns when the earliest lease expires if jobs
// still wait for a place (Redis clock), else the zero time.
func (g *Gate) sweep(ctx context.Context, subject string) (time.Time, error) {
	a, err := g.lim.Admit(ctx, throttle.AdmitRequest{Subject: subject, N: 0, Caller: throttle.Caller{Waiter: "sweep"}, Tolerance: time.Second})
	if err != nil {
		return time.Time{}, err
	}
	if a.Status != throttle.Booked || a.Lease == 0 {
		return time.Time{}, nil // nobody waits (or the limiter has no Concurrency rule now)
	}
	return a.Slot, nil
}

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
