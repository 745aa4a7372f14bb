package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/taskroute"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Waiter is what a TaskRule waits on for each task: a *throttle.Limiter, or
// any limiter that can wait.
type Waiter interface {
	// WaitN blocks until n permits for subject are granted, fails at once
	// with a *throttle.DelayError if they would come after ctx's deadline,
	// and refunds them and returns ctx.Err() if ctx ends while waiting.
	WaitN(ctx context.Context, subject string, n int) error
}

var _ Waiter = (*throttle.Limiter)(nil)

// TaskRule binds task types to a limiter and a subject.
type TaskRule struct {
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
	// Cost derives how many permits a task takes (FixedCost,
	// PayloadCost). If nil, every task takes one. A cost larger than a
	// limit can ever admit at once archives the task with a
	// error matching throttle.ErrExceedsCapacity. With a Cost, the cost
	// is an estimate that the handler may correct with SetCost once it
	// knows the real one (the tokens an LLM call used): the rule is
	// settled to it when the handler returns. Every limit of the
	// Limiter is charged the same cost; for limits of different costs
	// (requests beside tokens), see SetCost.
	Cost Cost
	// Costs, if set, derives what a task takes under each rule of the
	// Limiter (a *throttle.Limiter), in the order of its rules, in place
	// of Cost: an LLM call's requests, input tokens and output tokens,
	// decided in one call (throttle.Costs). A rule of cost 0 is not
	// charged and does not delay the task. They are estimates that the
	// handler may correct with SetCosts; a task whose costs are all 0
	// runs free.
	Costs Costs
	// Settings are how the rule's tasks are admitted (admission.Settings,
	// the rules file's max_wait, wait_slots, horizon, weights and
	// share_limit): MaxWait bounds how long a task may wait in its
	// handler, holding a worker slot, for a new turn (a later turn is
	// booked under its task ID and the task parks, deferred with a
	// *admission.ThrottledError until then), never longer than the task's
	// deadline allows; WaitSlots bounds how many tasks of one subject wait
	// so in this process at once; Horizon bounds how far ahead a parked
	// task's turn is booked (a task whose turn is later waits in its
	// subject's line in Redis, charged nothing, and is woken as the horizon
	// reaches it); Weights weigh FairBy's shares; ShareLimit also limits
	// each of FairBy's shares on its own, and needs FairBy and a
	// *throttle.Limiter without a concurrency rule. For a Limiter that
	// cannot book (not a *throttle.Limiter, such as one whose rules are
	// over several subjects), which defers the task to an estimate
	// instead, a zero MaxWait means only the task's deadline bounds the
	// wait. Without Options.Asynq (no wake-up loop to serve the line),
	// there is no line: every turn is booked at once.
	admission.Settings
	// FairBy, if set, divides the rule's limit fairly among the shares
	// (tenants) that have tasks waiting for one subject (one API key for
	// every tenant): each share's tasks wait in their own part of the
	// subject's line, and the shares are served in turn, so a tenant with
	// ten tasks queued behind another's ten thousand runs at its share
	// from its first task, and an idle tenant's share goes to the busy
	// ones. An error archives the task, as for Subject. Needs
	// Options.Asynq.
	FairBy Subject
	// Priority, if set, gives each task its level in its subject's line,
	// 0 to admission.MaxPriority: tasks of higher levels waiting for one
	// subject take the next turns before lower ones (the turns already
	// booked are kept), the shares of FairBy in turn within a level, and
	// a task that has waited Settings.MaxAge (if zero,
	// admission.DefaultMaxAge horizons) goes before every task that joined
	// after it. An error archives the task, as for Subject. Needs
	// Options.Asynq; not with ShareLimit or a concurrency limit.
	Priority Priority
	// Within, if set, names another rule of the middleware whose limit
	// also holds for this rule's tasks, over that rule's own subject and
	// cost (a per-key rule within a per-tenant one): a task is admitted
	// under both, holding a turn of each when it runs, and parks once, on
	// the slower limit, whatever the backlog (admission.Stack). That rule
	// may name another in turn; no rule may come back to itself. Both
	// rules need a *throttle.Limiter. The other rule still applies alone to
	// the task types it matches itself.
	Within string
}

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
// deadline. If the permit would come later, it returns a *admission.ThrottledError
// with the admission time, and asynq reschedules the task for that time
// without counting a failure, provided the server's asynq.Config uses
// IsFailure and RetryDelay (Configure sets both).
//
// A Middleware is safe for concurrent use.
type Middleware struct {
	table      atomic.Pointer[ruleTable] // swapped whole by Reload (reload.go)
	shared     *admission.Slots          // Options.MaxWaiting, kept across reloads; nil if unbounded
	source     *ruleSource               // what FromRules built the rules from; nil for NewMiddleware
	log        *slog.Logger
	metrics    *Metrics
	requeue    *requeuer
	parking    *admission.Parking // the wake-up ledger's parking and waking; nil without Options.Asynq
	redisRetry time.Duration
	drainCtx   context.Context
	drain      context.CancelFunc
	stopped    chan struct{} // closed when the wake-up loop has ended (nil without one)
	parks      *parkTally    // the parks logged in summary (parklog.go)
}

// ruleTable is the middleware's rules, by task type and by name. It is
// never changed once built: Reload stores a new one, and a task keeps the
// *ruleGate it was admitted by until its handler returns.
type ruleTable struct {
	route  taskroute.Router[*ruleGate]
	byName map[string]*ruleGate // for the wake-up loop (swap) and Explain
}

// ruleGate is a TaskRule with its admission gate (nil for a Limiter that is not a
// *throttle.Limiter, such as one whose rules are over several subjects, which waits in place).
type ruleGate struct {
	TaskRule
	gate *admission.Gate
	// leased: the limiter has a concurrency rule, so a task that waits in
	// place (waitInPlace) holds a place until its handler returns. Tasks
	// admitted through the gate hold their Decision.Place.
	leased bool
	// stacked: a throttling middleware inside this one has throttled one
	// of the rule's tasks (admit.go, stacked rules).
	stacked atomic.Bool
	// ruleUse counts the tasks using the rule, and closes the limiter the
	// worker built for it once retired and unused (owned.go).
	ruleUse
	// within are the rules TaskRule.Within names, outward, and stack
	// admits the rule's tasks under it and them (stack.go); nil without.
	within []*ruleGate
	stack  *admission.Stack
}

// Options configure a Middleware. The zero value uses every default.
type Options struct {
	// Logger receives the middleware's structured logs. If nil,
	// slog.Default() is used.
	Logger *slog.Logger
	// Metrics, if set, records the middleware's decisions.
	Metrics *Metrics
	// Asynq is the Redis client of the asynq server, which the middleware
	// uses for two things:
	//
	//   - Wake-ups. A parked task is recorded in a ledger in Asynq
	//     (admission.WakeupsKey, spread over WakeupShards keys), and every
	//     middleware with Asynq set runs a
	//     loop that moves each parked task to its queue's pending list
	//     (asynq's Inspector.RunTask) shortly before its turn, instead of
	//     waiting for asynq's own schedule, which keeps whole seconds. So
	//     parked tasks start on time and spread over the second, not
	//     together at its end. Without it, a parked task is scheduled a
	//     little before its turn, in whole seconds, and waits out the rest
	//     in its handler.
	//   - Tasks with no retry left (enqueued with asynq.MaxRetry(0), or on
	//     their last attempt after real failures), which asynq would
	//     archive if their handler returned any error, are parked by
	//     enqueueing a copy (same type, payload, headers, queue, timeout,
	//     deadline and retention; the retries it had left; the ID
	//     "<id>~throttled<n>") scheduled for the turn, and revoking the
	//     original (the returned error then matches asynq.RevokeTask as
	//     well as *admission.ThrottledError). Without it, such a task waits
	//     in its handler as long as its deadline allows, ignoring MaxWait,
	//     and is archived with a *admission.ThrottledError only if even
	//     that is not enough.
	//
	// If nil, neither. With it, call Drain (or Close) when the server
	// stops, to end the wake-up loop.
	Asynq redis.UniversalClient
	// WakeupShards is how many keys the wake-up ledger is spread over
	// (admission.NewShardedWakeups), each in its own hash slot. Give every
	// worker and producer of a fleet the same number; a worker given more
	// than a producer still wakes all its tasks, so raise it on the
	// workers first. If zero, admission.DefaultWakeupShards (3).
	WakeupShards int
	// MaxWaiting bounds how many tasks, of every rule and subject
	// together, wait in their handlers for a new turn (see
	// TaskRule.WaitSlots) in this process: give about half the server's
	// concurrency, so that however many subjects are over their limits,
	// the other half of the worker slots stays free for tasks that can
	// run. If zero or negative, only each rule's WaitSlots per subject
	// bounds them. cmd/worker sets half its concurrency.
	MaxWaiting int
	// RedisRetryDelay is how long a task is deferred when its limiter
	// cannot reach Redis. If zero or negative, DefaultRedisRetryDelay.
	RedisRetryDelay time.Duration
}

// NewMiddleware returns a Middleware applying rules. It returns an error
// naming the rule and field if a rule is incomplete (no name, no tasks, no
// Limiter or no Subject), if two rules share a name or a pattern, or if a
// pattern is empty or has a '*' other than at its end.
func NewMiddleware(rules []TaskRule, opts Options) (*Middleware, error) {
	m := &Middleware{
		log:        opts.Logger,
		metrics:    opts.Metrics,
		redisRetry: opts.RedisRetryDelay,
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	if m.redisRetry <= 0 {
		m.redisRetry = DefaultRedisRetryDelay
	}
	m.parks = &parkTally{log: m.log, every: ParkSummaryEvery}
	if opts.Asynq != nil {
		m.requeue = &requeuer{client: asynq.NewClientFromRedisClient(opts.Asynq), insp: asynq.NewInspectorFromRedisClient(opts.Asynq)}
		ledger, err := admission.NewShardedWakeups(opts.Asynq, admission.WakeupsKey, opts.WakeupShards)
		if err == nil {
			m.parking, err = admission.NewParking(ledger, admission.ParkingOptions{Logger: m.log, OnServe: func(rule, subject string, s admission.Served) {
				m.metrics.lineServed(rule, subject, s)
			}})
		}
		if err != nil {
			return nil, fmt.Errorf("worker: %w", err)
		}
	}
	if opts.MaxWaiting > 0 {
		m.shared = admission.NewSlots(opts.MaxWaiting)
	}
	t, err := m.newTable(rules)
	if err != nil {
		return nil, err
	}
	m.swap(t)
	m.drainCtx, m.drain = context.WithCancel(context.Background())
	if m.parking != nil {
		m.stopped = make(chan struct{})
		go m.wakeLoop()
	}
	return m, nil
}

// newTable checks rules as NewMiddleware documents and builds their
// table, with an admission gate for each *throttle.Limiter. It changes
// nothing in m.
func (m *Middleware) newTable(rules []TaskRule) (*ruleTable, error) {
	t := &ruleTable{byName: map[string]*ruleGate{}}
	owner := map[string]string{} // pattern → rule
	for i := range rules {
		r := &rules[i]
		if r.Name == "" {
			return nil, fmt.Errorf("worker: rule %d: name: must not be empty", i)
		}
		if t.byName[r.Name] != nil {
			return nil, ruleError(r.Name, "name", "is used by two rules; names must be unique")
		}
		if err := m.checkRule(r); err != nil {
			return nil, err
		}
		rule, err := m.newRuleGate(r)
		if err != nil {
			return nil, err
		}
		t.byName[r.Name] = rule
		for _, p := range rule.Tasks {
			if err := taskroute.CheckPattern(p); err != nil {
				return nil, ruleError(r.Name, "tasks", err.Error())
			}
			if other, dup := owner[p]; dup {
				return nil, ruleError(r.Name, "tasks", fmt.Sprintf("pattern %q is also in rule %q; a task type takes one rule", p, other))
			}
			owner[p] = r.Name
			t.route.Add(p, rule)
		}
	}
	if err := t.stackRules(); err != nil {
		return nil, err
	}
	return t, nil
}

// ruleError is the error of a TaskRule's field.
func ruleError(rule, field, reason string) error {
	return fmt.Errorf("worker: rule %q: %s: %s", rule, field, reason)
}

// checkRule checks the fields of r that need no limiter.
func (m *Middleware) checkRule(r *TaskRule) error {
	bad := func(field, reason string) error { return ruleError(r.Name, field, reason) }
	switch {
	case len(r.Tasks) == 0:
		return bad("tasks", "must list at least one task type or pattern")
	case r.Limiter == nil:
		return bad("limiter", "must not be nil; use a *throttle.Limiter")
	case r.Subject == nil:
		return bad("subject", "must not be nil; use Fixed, PayloadField or a func")
	case r.FairBy != nil && m.parking == nil:
		return bad("fair_by", "needs Options.Asynq: the wake-up loop serves the subject's line")
	case r.ShareLimit != (throttle.Limit{}) && r.FairBy == nil:
		return bad("share_limit", "limits each share of fair_by; set fair_by too")
	case r.Costs != nil && r.Cost != nil:
		return bad("costs", "set Cost or Costs, not both")
	case r.Costs != nil && !isCostsWaiter(r.Limiter):
		return bad("costs", "need a *throttle.Limiter, which charges each of its rules its own cost")
	case r.Priority != nil && m.parking == nil:
		return bad("priority", "needs Options.Asynq: the wake-up loop serves the subject's line, which orders tasks by priority")
	case r.Priority != nil && r.ShareLimit != (throttle.Limit{}):
		return bad("priority", "cannot be combined with share_limit: a share its own limit holds back is served in its share's order, not by level; drop one")
	}
	return settingsError(r.Name, r.Settings.Check())
}

// settingsError is err, a field of a rule's Settings out of range (a
// *admission.SettingsError), as the error of the rule named rule's
// field; any other err as the error of its limiter; nil if err is.
func settingsError(rule string, err error) error {
	var se *admission.SettingsError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &se):
		return ruleError(rule, se.Field, se.Reason)
	}
	return ruleError(rule, "limiter", err.Error())
}

// newRuleGate returns r with its admission gate, if its Limiter is a
// *throttle.Limiter, recording its parked tasks' wake-ups in m's parking.
func (m *Middleware) newRuleGate(r *TaskRule) (*ruleGate, error) {
	rule := &ruleGate{TaskRule: *r}
	rule.Tasks = append([]string(nil), r.Tasks...)
	lim, ok := r.Limiter.(*throttle.Limiter)
	if !ok {
		if r.ShareLimit != (throttle.Limit{}) {
			return nil, ruleError(r.Name, "share_limit", "needs a *throttle.Limiter: it is kept in the subject's line")
		}
		return rule, nil
	}
	gateOpts := admission.Options{Settings: r.Settings, Shared: m.shared, Parking: m.parking, Name: r.Name}
	if r.Priority != nil {
		// Every task of the rule ages, those of level 0 too.
		gateOpts.MaxAge = r.AgeBound()
	}
	if m.parking == nil {
		// Parked tasks come back in whole seconds, up to a second
		// early (see park): let them wait that out in place.
		// Nobody serves a line: every turn is booked at once.
		gateOpts.EarlyWait, gateOpts.Horizon = earlyWaitUnwoken, -1
	}
	var err error
	if rule.gate, err = admission.New(lim, gateOpts); err != nil {
		// The settings against the limiter's rules (a share limit).
		return nil, settingsError(r.Name, err)
	}
	rule.leased = rule.gate.Leased()
	if rule.leased && r.FairBy != nil {
		return nil, ruleError(r.Name, "fair_by", "cannot share a concurrency limit: its queue for places is first come, first served")
	}
	if rule.leased && r.Priority != nil {
		return nil, ruleError(r.Name, "priority", "cannot order a concurrency limit's queue: its places are handed first come, first served")
	}
	return rule, nil
}

// swap puts t in force: tasks that arrive take its rules, and the wake-up
// loop serves its gates' lines (a rule t no longer has is retired: its
// servings are dropped).
func (m *Middleware) swap(t *ruleTable) {
	m.table.Store(t)
	if m.parking == nil {
		return
	}
	gates := make(map[string]*admission.Gate, len(t.byName))
	for name, r := range t.byName {
		gates[name] = r.gate
	}
	m.parking.Serve(gates)
}

// rule returns the rule for a task type, or nil.
func (m *Middleware) rule(taskType string) *ruleGate {
	r, _ := m.table.Load().route.Lookup(taskType)
	return r
}

// ruleNamed returns the rule named name in the current rules, or nil.
func (m *Middleware) ruleNamed(name string) *ruleGate { return m.table.Load().byName[name] }

// Wrap returns next throttled by the middleware's rules: an
// asynq.MiddlewareFunc for ServeMux.Use.
func (m *Middleware) Wrap(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		if m.parking != nil {
			// Stacked middlewares over one ledger pass each other the
			// servings of their lines (admission.Parking.Join).
			ctx = m.parking.Join(ctx)
		}
		r, ok := m.use(task.Type())
		switch {
		case r == nil:
			return next.ProcessTask(ctx, task)
		case !ok:
			// Drained, and the rule's limiter closed with it.
			m.metrics.decided(r.Name, admission.LabelDeferred)
			return &admission.ThrottledError{Rule: r.Name, RetryAt: time.Now(), Err: ErrDraining}
		}
		defer r.done() // after the place is released, below
		if !r.useWithin() {
			// Drained: a rule it is within is retired with it.
			m.metrics.decided(r.Name, admission.LabelDeferred)
			return &admission.ThrottledError{Rule: r.Name, RetryAt: time.Now(), Err: ErrDraining}
		}
		defer r.doneWithin()
		ctx, rep := withCostReport(ctx)
		t, err := m.admit(ctx, r, task)
		if err != nil {
			rep.notRun() // an outer rule's turn goes back (settle.go)
			return err
		}
		for _, h := range t.held(r) {
			if h.place != nil {
				m.metrics.holding(h.rule.Name, 1)
				defer func() { m.release(h.rule, h.place, h.Wait); m.metrics.holding(h.rule.Name, -1) }()
			}
		}
		err = next.ProcessTask(admission.WithWait(ctx, t.Wait), task)
		for _, h := range t.held(r) {
			m.settle(ctx, h.rule, task, h.turn, rep)
		}
		if te := (*admission.ThrottledError)(nil); !r.stacked.Load() && errors.As(err, &te) && rep.wasSkipped() {
			// A middleware inside this one throttled the task (it did
			// not run the handler): from now on, this rule books its
			// tasks' turns however far ahead (admit.go, stacked rules).
			// A handler's own ThrottledError (an upstream's 429, a
			// pause) is no such middleware: taken for one, it took the
			// rule out of its line for good, and the tasks already in
			// line waited there behind turns booked past the horizon
			// (issue 19's header-less tail).
			r.stacked.Store(true)
		}
		return err
	})
}

// Drain ends every wait in progress, deferring those tasks (cause
// ErrDraining, RetryAt now: another worker takes them up), makes every
// later throttled task defer at once, and ends the wake-up loop (the other
// workers' loops wake the parked tasks). Call it when shutting down, after
// asynq.Server.Stop and before Shutdown, so that Shutdown does not wait up
// to ShutdownTimeout for tasks that are only waiting. Tasks on their last
// attempt are not drained unless Options.Asynq is set (deferring would
// archive them); asynq puts them back in their queue when ShutdownTimeout
// passes. It logs the summary of the parks counted since the last one
// (ParkSummaryEvery) at once. The limiters FromRules (or Reload) built are
// closed (throttle.Limiter.Close), each once no task uses it; a task that
// comes after Drain is deferred at once (cause ErrDraining). Limiters
// given to NewMiddleware are the caller's: Drain never closes them. Drain
// cannot be undone.
func (m *Middleware) Drain() {
	m.drain()
	if m.stopped != nil {
		<-m.stopped
	}
	m.parks.stop()
	if m.source != nil {
		m.source.mu.Lock() // no Reload between the table read and its retirement
		defer m.source.mu.Unlock()
	}
	retireAll(m.table.Load())
}

// Close is Drain: it releases what the middleware runs in the background.
func (m *Middleware) Close() error {
	m.Drain()
	return nil
}
