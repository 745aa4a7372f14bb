package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/rules"
)

// This file answers an operator's question "why is this task not running?"
// (cmd/worker explain): asynq's state of the task, and what the rules'
// limiters and the wake-up ledger keep about it in Redis.

// Explanation is Explain's answer: where a task is and why. Its JSON form
// is what `cmd/worker explain --json` prints; fields may be added, none is
// renamed or removed. Times are UTC; Now and the times of the limiters
// (Turn, Receipt, Wakeup, LineServing) are on the Redis clock, asynq's
// (NextProcessAt, LastErrorAt, CompletedAt, Running) on the clocks of the
// processes that wrote them.
type Explanation struct {
	// TaskID is the task found: ID asked for, or its requeued copy
	// ("<id>~throttled<n>", see Options.Asynq) if the original is gone.
	TaskID string `json:"task_id"`
	// Asked is the ID asked for, if TaskID is its copy; empty otherwise.
	Asked string `json:"asked,omitempty"`
	Queue string `json:"queue"`
	Type  string `json:"type"`
	// Status is where the task is, in one word (see Status).
	Status Status `json:"status"`
	// State is asynq's state of the task: active, pending, scheduled,
	// retry, archived, completed or aggregating.
	State string `json:"state"`
	// Retried and MaxRetry are asynq's: failures so far and the most
	// allowed. A park is not a failure: it counts in neither.
	Retried  int `json:"retried"`
	MaxRetry int `json:"max_retry"`
	// NextProcessAt is when asynq moves a scheduled or retry task to
	// pending (whole seconds); nil for other states.
	NextProcessAt *time.Time `json:"next_process_at,omitempty"`
	// LastError is asynq's last error of the task: a handler's failure, or
	// for a parked task the text of its *admission.ThrottledError.
	LastError string `json:"last_error,omitempty"`
	// LastErrorAt is when the last error was recorded: the task's last
	// park or failure (asynq's LastFailedAt, whole seconds).
	LastErrorAt *time.Time `json:"last_error_at,omitempty"`
	// LastWait is LastError read back when it is a wait, not a failure:
	// the rule, subject and time the task last waited for; nil otherwise.
	LastWait *Wait `json:"last_wait,omitempty"`
	// CompletedAt is when a completed task finished.
	CompletedAt *time.Time `json:"completed_at,omitempty"`
	// Running says where an active task runs; nil if no live worker
	// reports it (Orphaned).
	Running *Running `json:"running,omitempty"`
	// Orphaned: asynq has the task active, but its worker stopped
	// renewing its lease; asynq gives it back to its queue.
	Orphaned bool `json:"orphaned,omitempty"`
	// EnqueuedAt is when a jobthrottle producer enqueued the task
	// (admission.EnqueuedHeader); nil if none stamped it.
	EnqueuedAt *time.Time `json:"enqueued_at,omitempty"`
	// Requeues is how many times the task was parked as a copy (a task
	// with no retry left): the n of "<id>~throttled<n>"; 0 for others. No
	// other park is counted anywhere: LastErrorAt is the latest.
	Requeues int `json:"requeues"`
	// RulesKnown reports that Explain was given the workers' rules: Rule
	// is then nil only if no rule applies to the task's type.
	RulesKnown bool `json:"rules_known"`
	// Rule is what the rule of the task's type keeps about it; nil if no
	// rule applies, or the rules are not known.
	Rule *RuleState `json:"rule,omitempty"`
	// Wakeup is when the wake-up loop will move the parked task to
	// pending (the ledger admission.WakeupsKey); nil if it is not there.
	Wakeup *time.Time `json:"wakeup,omitempty"`
	// Now is the Redis clock when Explain read the limiters.
	Now time.Time `json:"now"`
}

// Status is where a task is, in one word.
type Status string

// The statuses of Explanation.Status.
const (
	StatusRunning     Status = "running"     // asynq's active: a worker runs it (or waits in it for its turn)
	StatusPending     Status = "pending"     // in its queue, for the next free worker
	StatusParked      Status = "parked"      // waiting for its turn (a rule's booking, its subject's line, a place); not failed
	StatusScheduled   Status = "scheduled"   // enqueued for later by its producer
	StatusRetrying    Status = "retrying"    // failed, waiting for asynq's retry
	StatusArchived    Status = "archived"    // failed for good, or archived by hand
	StatusCompleted   Status = "completed"   // done, kept for its retention
	StatusAggregating Status = "aggregating" // in an asynq group, waiting to be aggregated
)

// Wait is what a parked task's last error says it waited for: its
// *admission.ThrottledError, read back (admission.ParseThrottledError).
type Wait struct {
	Rule    string `json:"rule"`
	Subject string `json:"subject"`
	// RunsAgainAt is the time the task was parked until (its turn, or the
	// fallback of a task in its subject's line).
	RunsAgainAt time.Time `json:"runs_again_at"`
	// Requeued is the copy the task was parked as, if any.
	Requeued string `json:"requeued,omitempty"`
	// Cause is why it waited: "worker: parked until its booked turn", a
	// Redis failure, a drain for shutdown, ...
	Cause string `json:"cause,omitempty"`
}

// Running says where an active task runs, as its asynq server reports it.
type Running struct {
	Host string `json:"host"`
	PID  int    `json:"pid"`
	// Started is when the worker started the task; Deadline when it must
	// end (zero if none).
	Started  time.Time  `json:"started"`
	Deadline *time.Time `json:"deadline,omitempty"`
}

// RuleState is what the rule of a task's type, and its limiter's keys in
// Redis, say about the task.
type RuleState struct {
	// Name is the rule's name; Limits are its limits' names (the last part
	// of their Redis keys).
	Name   string   `json:"name"`
	Limits []string `json:"limits"`
	// Subject is what the rule limits for this task, from its payload;
	// SubjectError says why there is none (such a task is archived).
	Subject      string `json:"subject,omitempty"`
	SubjectError string `json:"subject_error,omitempty"`
	// NoBookings says why the rule keeps nothing per task (limits over
	// several subjects wait in place or defer); empty if it does.
	NoBookings string `json:"no_bookings,omitempty"`
	// Turn is the turn booked for the task (Redis clock): it runs then.
	// With TurnPaid, the turn has come and is paid, and the task waits for
	// a place of the rule's concurrency limit.
	Turn     *time.Time `json:"turn,omitempty"`
	TurnPaid bool       `json:"turn_paid,omitempty"`
	// Receipt is the turn its producer booked for it at enqueue time
	// (admission.ReceiptHeader), while not yet redeemed.
	Receipt *time.Time `json:"receipt,omitempty"`
	// InLine reports that the task waits in its subject's line, no turn
	// booked yet; Position is its position in it (1: next) of LineLength.
	InLine     bool `json:"in_line"`
	Position   int  `json:"position,omitempty"`
	LineLength int  `json:"line_length,omitempty"`
	// LineServing is when the wake-up loop next serves the subject's line
	// (books the turns of its head); nil if no serving is scheduled.
	LineServing *time.Time `json:"line_serving,omitempty"`
	// Priority is the task's level in its subject's line, 0 to
	// admission.MaxPriority, higher levels served first, where the rule
	// has a priority (nil otherwise, or if the task has none it can read:
	// PriorityError, such a task is archived when it runs). MaxAgeSeconds
	// is then the rule's age bound: a task that has waited that long in
	// line goes before every task that joined after it, whatever its
	// level.
	Priority      *int    `json:"priority,omitempty"`
	PriorityError string  `json:"priority_error,omitempty"`
	MaxAgeSeconds float64 `json:"max_age_seconds,omitempty"`
	// Concurrency is the name of the rule's concurrency limit, if it has
	// one. Holding: the task holds one of its places (it runs, or was
	// handed one and is being woken). QueuedForPlace: its position in
	// the queue for one (1: next); 0 if not queued.
	Concurrency    string `json:"concurrency,omitempty"`
	Holding        bool   `json:"holding,omitempty"`
	QueuedForPlace int    `json:"queued_for_place,omitempty"`
}

// ExplainOptions tune Explain. The zero value looks in every queue and
// knows no rules.
type ExplainOptions struct {
	// Queue is the queue to look in; if empty, every queue asynq knows.
	Queue string
	// Rules are the workers' rules (their rules file). With them,
	// Explain names the rule and subject of the task and reads its
	// booking, its position in its subject's line and under a
	// concurrency limit; without them (nil), the rule is known only from
	// the task's last error.
	Rules *rules.Config
	// WakeupShards is the number of keys of the workers' wake-up ledger
	// (Options.WakeupShards); if zero, admission.DefaultWakeupShards.
	WakeupShards int
}

// Errors of Explain, besides Redis's.
var (
	// ErrAmbiguousTask: the ID is in several queues; name one
	// (ExplainOptions.Queue).
	ErrAmbiguousTask = errors.New("worker: explain: the task ID is in several queues")
)

// TaskNotFoundError is Explain's error for an ID that no queue holds,
// nor a requeued copy of it. It matches asynq.ErrTaskNotFound.
type TaskNotFoundError struct {
	ID     string
	Queues []string // the queues looked in
}

func (e *TaskNotFoundError) Error() string {
	if len(e.Queues) == 0 {
		return fmt.Sprintf("worker: explain: no task %q: this Redis has no asynq queue (check the Redis URL)", e.ID)
	}
	return fmt.Sprintf("worker: explain: no task %q in %s, nor a copy %q: a completed task is kept only if enqueued with asynq.Retention, and a deleted one is gone",
		e.ID, queueList(e.Queues), nextCopyID(e.ID))
}

// Unwrap returns asynq.ErrTaskNotFound.
func (e *TaskNotFoundError) Unwrap() error { return asynq.ErrTaskNotFound }

// maxCopyLookups bounds how many generations of requeued copies Explain
// tries for an ID no queue holds.
const maxCopyLookups = 32

// Explain says where the task with ID id is and why: asynq's state of it,
// and, for a task a rule applies to, its booked turn, its position in its
// subject's line, its place (or position in the queue for one) under a
// concurrency limit and its wake-up.
// rdb is the Redis of asynq and of the limiters (one Redis, as cmd/worker
// has). An ID no queue holds is followed to its requeued copies
// ("<id>~throttled<n>"). It changes nothing of the task or the limiters
// (asynq's inspector drops expired entries of its server list as it
// lists the servers, for a running task).
//
// It returns a *TaskNotFoundError if no queue holds the task, an error
// matching ErrAmbiguousTask if several do, and an error wrapping Redis's
// if Redis fails.
func Explain(ctx context.Context, rdb redis.UniversalClient, id string, opts ExplainOptions) (*Explanation, error) {
	if id == "" {
		return nil, errors.New("worker: explain: empty task ID")
	}
	ledger, err := admission.NewShardedWakeups(rdb, admission.WakeupsKey, opts.WakeupShards)
	if err != nil {
		return nil, fmt.Errorf("worker: explain: %w", err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	info, err := findTask(insp, id, opts.Queue)
	if err != nil {
		return nil, err
	}
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("worker: explain: reading the Redis clock: %w", err)
	}
	e := newExplanation(info, now)
	if info.ID != id {
		e.Asked = id
	}
	if info.State == asynq.TaskStateActive && !info.IsOrphaned {
		if e.Running, err = runningOn(insp, info); err != nil {
			return nil, err
		}
	}
	if e.Wakeup, err = wakeupTime(ctx, ledger, admission.JobEntry{Queue: info.Queue, ID: info.ID}.Member()); err != nil {
		return nil, fmt.Errorf("worker: explain: reading the wake-up ledger: %w", err)
	}
	if opts.Rules != nil {
		e.RulesKnown = true
		if rc, ok := opts.Rules.RuleFor(info.Type); ok {
			if e.Rule, err = readRule(ctx, rdb, ledger, opts.Rules.Prefix, rc, info); err != nil {
				return nil, err
			}
		}
	}
	e.Status = e.status()
	return e, nil
}

// newExplanation is what asynq's TaskInfo says, at now on the Redis clock.
func newExplanation(info *asynq.TaskInfo, now time.Time) *Explanation {
	e := &Explanation{TaskID: info.ID, Queue: info.Queue, Type: info.Type, State: info.State.String(),
		Retried: info.Retried, MaxRetry: info.MaxRetry, LastError: info.LastErr, Orphaned: info.IsOrphaned,
		LastErrorAt: timeOrNil(info.LastFailedAt),
		CompletedAt: timeOrNil(info.CompletedAt), Now: now.UTC()}
	_, gen := splitCopyID(info.ID)
	e.Requeues = int(gen)
	if info.State == asynq.TaskStateScheduled || info.State == asynq.TaskStateRetry {
		e.NextProcessAt = timeOrNil(info.NextProcessAt)
	}
	if te, ok := admission.ParseThrottledError(info.LastErr); ok {
		e.LastWait = &Wait{Rule: te.Rule, Subject: te.Subject, RunsAgainAt: te.RetryAt.UTC(), Requeued: te.Requeued}
		if te.Err != nil {
			e.LastWait.Cause = te.Err.Error()
		}
	}
	if us, err := strconv.ParseInt(info.Headers[admission.EnqueuedHeader], 10, 64); err == nil && us > 0 {
		e.EnqueuedAt = timeOrNil(time.UnixMicro(us))
	}
	return e
}

// status is the task's Status: asynq's state, except that a scheduled or
// retry task that waits for its turn is parked.
func (e *Explanation) status() Status {
	switch e.State {
	case asynq.TaskStateActive.String():
		return StatusRunning
	case asynq.TaskStatePending.String():
		return StatusPending
	case asynq.TaskStateArchived.String():
		return StatusArchived
	case asynq.TaskStateCompleted.String():
		return StatusCompleted
	case asynq.TaskStateAggregating.String():
		return StatusAggregating
	}
	r := e.Rule
	waiting := e.LastWait != nil || e.Wakeup != nil || e.Requeues > 0 ||
		r != nil && (r.Turn != nil || r.InLine || r.QueuedForPlace > 0)
	switch {
	case waiting:
		return StatusParked
	case e.State == asynq.TaskStateRetry.String():
		return StatusRetrying
	}
	return StatusScheduled
}

// findTask returns the task id in queue (every queue if empty), or its
// latest requeued copy if the task itself is gone.
func findTask(insp *asynq.Inspector, id, queue string) (*asynq.TaskInfo, error) {
	queues := []string{queue}
	if queue == "" {
		var err error
		if queues, err = insp.Queues(); err != nil {
			return nil, fmt.Errorf("worker: explain: listing the queues: %w", err)
		}
		slices.Sort(queues)
	}
	cid := id
	for range maxCopyLookups + 1 {
		info, err := lookIn(insp, queues, cid)
		if info != nil || err != nil {
			return info, err
		}
		cid = nextCopyID(cid)
	}
	return nil, &TaskNotFoundError{ID: id, Queues: queues}
}

// lookIn returns the task id of the one queue of queues that holds it, or
// nil if none does.
func lookIn(insp *asynq.Inspector, queues []string, id string) (*asynq.TaskInfo, error) {
	var found *asynq.TaskInfo
	var in []string
	for _, q := range queues {
		info, err := insp.GetTaskInfo(q, id)
		switch {
		case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
			continue
		case err != nil:
			return nil, fmt.Errorf("worker: explain: reading task %q in queue %q: %w", id, q, err)
		}
		found, in = info, append(in, q)
	}
	if len(in) > 1 {
		return nil, fmt.Errorf("%w: %q is in %s; name one", ErrAmbiguousTask, id, queueList(in))
	}
	return found, nil
}

// runningOn returns where an active task runs, from its server's report;
// nil if no server reports it.
func runningOn(insp *asynq.Inspector, info *asynq.TaskInfo) (*Running, error) {
	servers, err := insp.Servers()
	if err != nil {
		return nil, fmt.Errorf("worker: explain: listing asynq's servers: %w", err)
	}
	for _, s := range servers {
		for _, w := range s.ActiveWorkers {
			if w.TaskID == info.ID && w.Queue == info.Queue {
				return &Running{Host: s.Host, PID: s.PID, Started: w.Started.UTC(), Deadline: timeOrNil(w.Deadline)}, nil
			}
		}
	}
	return nil, nil
}

// queueList names queues in prose: queue "a", queues "a", "b".
func queueList(queues []string) string {
	q := make([]string, len(queues))
	for i, s := range queues {
		q[i] = strconv.Quote(s)
	}
	if len(q) == 1 {
		return "queue " + q[0]
	}
	return "queues " + strings.Join(q, ", ")
}

// timeOrNil returns t in UTC, or nil for the zero time.
func timeOrNil(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	t = t.UTC()
	return &t
}
