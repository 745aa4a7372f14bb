package throttle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options configure a Limiter. The zero value is a fail-closed limiter
// under DefaultPrefix whose waits are bounded only by their contexts.
type Options struct {
	// Prefix starts every key. If empty, DefaultPrefix ("jobthrottle:") is
	// used. It must not contain '{' or '}', which would break the
	// subject's hash tag.
	Prefix string
	// MaxWait bounds how long Wait may block and how far ahead Reserve may
	// book. If zero, only the context's deadline bounds them.
	MaxWait time.Duration
	// FailOpen admits requests while Redis cannot be reached. If false
	// (the default), Allow, Reserve and Wait return the error instead.
	FailOpen bool
	// Logger receives a warning when a fail-open limiter starts admitting
	// without Redis, and a note when Redis answers again. If nil,
	// slog.Default() is used.
	Logger *slog.Logger
	// OnRedisError, if set, is called with every error from Redis, after
	// FailOpen has decided; failedOpen tells whether the request was
	// admitted anyway. Use it for metrics. It must not block. Window
	// waiters queued in this process behind one whose call failed take
	// that answer without asking Redis again; each reports it here too.
	// A call its caller ended (a cancelled context, or one past its
	// deadline) is no Redis error: the caller gets the context's error,
	// and the hook is not called.
	OnRedisError func(err error, failedOpen bool)
	// NoBatching sends every AllowN as its own EVALSHA. By default,
	// concurrent AllowN calls of one Limiter go out together in one
	// pipeline: a lone call is still sent at once, on its own,
	// but many goroutines calling Allow cost the client and Redis one
	// write and one read per batch instead of per call. A go-redis hook
	// sees a batch in ProcessPipelineHook, not in ProcessHook.
	NoBatching bool
	// OnHandoff, if set, is called with the waiters (AdmitRequest.Waiter)
	// that a call of this limiter handed a freed place of its Concurrency
	// rule to, so that the caller wakes them: they were parked, and come
	// back to take the place. The asynq worker sets it
	// (worker.WakeOnHandoff). If nil, a parked waiter comes back at its
	// fallback time (Admission.At). Waiters in Wait in this process are
	// woken directly. It must not block for long.
	OnHandoff func(waiters []string)
	// LocalLease, if above zero, serves one hot subject past what one
	// Redis shard can decide (tens of thousands of script calls a
	// second): where this process's own demand for a subject is high,
	// Allow and Wait hand out permits from runs of the bucket's slots
	// taken from Redis in one call, in arrival order, each no earlier
	// than its slot on the Redis clock and at most LocalLease after it. In
	// any window, admissions then exceed the exact bound (Burst + Rate ×
	// window) by at most Rate × LocalLease: 5ms is at most 0.5 % of a
	// per-second limit. Where demand is low (a few per second) every call
	// goes to Redis as without it, exactly. It needs exactly one
	// TokenBucket or GCRA rule over the caller's subject, and at most a
	// tenth of its Period (else a *ConfigError). ReserveN, Admit, PrepayN
	// and AllowAtMost take no runs. See the package doc, "One hot key". If
	// zero (the default), no run is taken. (Its name is older than the
	// package's words: it holds no place's lease.)
	LocalLease time.Duration
	// PrepayAfter is the soonest a slot booked by PrepayN may be, from the
	// call: the time a job needs to reach whoever redeems its receipt (a
	// queue's delay from enqueue to a worker). A slot sooner finds the job
	// late, its receipt stale, and the job is charged a second time. A
	// policy of TokenBucket and GCRA rules decides as if called that much
	// later (so the turns before then go unused, by anyone); a policy
	// with another rule ignores it. If zero (the default), a slot may be
	// now. At most maxPeriod.
	PrepayAfter time.Duration
	// Line, if set, names the subject's line (AdmitRequest.Horizon) in its
	// keys, <prefix>{<subject>}:!line(<Line>), instead of the rules' names:
	// two limiters over the same rules then keep a line each, as two
	// limiters over different rules do. A limiter whose callers' shares
	// have limits of their own (AdmitRequest.ShareLimit: each API key of a
	// tenant) keeps them in its line, so it needs a line no caller without
	// them serves (the worker's rules file: nested). At most 256 bytes,
	// escaped in the key as a rule's name is.
	Line string
}

// A Limiter decides, through Redis, whether a subject (a tenant, an API
// key, a host) may go ahead under one or more rules. Every rule of the
// limiter is checked and charged together, in one atomic script call: a
// denied request charges no rule. Limiters on different machines that use
// the same Redis, prefix and rules share their limits.
//
// A Limiter is safe for concurrent use.
type Limiter struct {
	policy               // the rules, their keys and script arguments (policy.go)
	runner               // Redis: script calls, fail-open, hooks (run.go)
	opts    Options      // as given, with a Logger
	clock   redisClock   // maps Redis TIME to local time for waking (clock.go)
	batch   allowBatcher // concurrent AllowN calls sent together (batch.go)
	queues  windowQueues // window waits, by encoded subject (window.go)
	refunds refunder     // refunds waiting for a call, by escaped subject (refund.go)
	mode    mode         // how it decides, chosen by New (modes.go)
	closed  atomic.Bool  // Close was called (close.go)
	bg      goroutines   // its own goroutines, which Close ends (close.go)
	upLoad  sync.Once    // the upstream scripts loaded ahead (Upstream)
}

// New returns a Limiter that applies every rule to each subject. It returns
// a *ConfigError if a rule or an option is invalid, naming the rule and
// field, and an error if rdb is nil or no rule is given.
func New(rdb redis.UniversalClient, opts Options, rules ...Rule) (*Limiter, error) {
	if rdb == nil {
		return nil, errors.New("throttle: nil Redis client")
	}
	if len(rules) == 0 {
		return nil, errors.New("throttle: no rules: give at least one Rule")
	}
	if strings.ContainsAny(opts.Prefix, "{}") {
		return nil, &ConfigError{Field: "prefix", Reason: fmt.Sprintf("%q must not contain '{' or '}'", opts.Prefix)}
	}
	if opts.MaxWait < 0 {
		return nil, &ConfigError{Field: "max_wait", Reason: fmt.Sprintf("%v must not be negative", opts.MaxWait)}
	}
	if opts.PrepayAfter < 0 || opts.PrepayAfter > maxPeriod {
		return nil, &ConfigError{Field: "prepay_after", Reason: fmt.Sprintf("%v must be between 0 and %v", opts.PrepayAfter, maxPeriod)}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if len(opts.Line) > 256 {
		return nil, &ConfigError{Field: "line", Reason: fmt.Sprintf("%d bytes long, at most 256", len(opts.Line))}
	}
	p, err := newPolicy(opts.Prefix, rules)
	if err != nil {
		return nil, err
	}
	p.lineName = escape(opts.Line)
	run := opts
	run.Prefix = p.prefix // for log entries
	l := &Limiter{policy: p, runner: runner{rdb: rdb, opts: run, calendar: newCalendarStamp(p.rules)}, opts: opts}
	if l.mode, err = chooseMode(l); err != nil {
		return nil, err
	}
	return l, nil
}

// With returns a Limiter over other rules that shares l's Redis client and
// options: another limit on the same ledger, such as one learned from an
// upstream's answers. LocalLease is not carried over: it is sized for l's
// one hot rule, and another rule (a slow learned one) need not fit it.
// Errors are New's.
func (l *Limiter) With(rules ...Rule) (*Limiter, error) {
	opts := l.opts
	opts.LocalLease = 0
	return New(l.rdb, opts, rules...)
}

// Rules returns a copy of the rules l applies, as given to New (names,
// algorithms, limits, subjects); a CalendarWindow rule's zero Period and
// Burst are filled in (its calendar unit's nominal length, its Count).
func (l *Limiter) Rules() []Rule { return slices.Clone(l.rules) }

// Result is the outcome of Allow.
type Result struct {
	// Allowed reports whether the permits were granted (and charged).
	Allowed bool
	// Remaining is how many more permits the tightest rule would grant
	// right now: after this request if it was allowed.
	Remaining int
	// Rule names the rule that decided: the one that denied with the
	// longest delay, or, if allowed, the one with the fewest remaining.
	Rule string
	// Limit is the deciding rule's limit.
	Limit Limit
	// RetryAfter is zero if allowed; otherwise how long from now until a
	// request of the same size would be admitted, if nothing else is
	// admitted before it.
	RetryAfter time.Duration
	// ResetAfter is how long until every rule is back to full capacity.
	ResetAfter time.Duration
}

// Allow reports whether one permit for subject is available now, and
// takes it if so. It is AllowN(ctx, subject, 1).
func (l *Limiter) Allow(ctx context.Context, subject string) (Result, error) {
	return l.AllowN(ctx, subject, 1)
}

// AllowN takes n permits for subject if every rule has them now, and
// none otherwise. It never waits. It returns an error matching ErrExceedsCapacity if n is
// more than a rule can ever admit at once, and an error matching ErrRedis
// if Redis fails (unless FailOpen, which allows).
//
// n = 0 is the state read, for every algorithm: it charges nothing and
// reports Remaining and ResetAfter under every rule. Allowed is false
// only while a request of 0 would have to wait (reservations or a pause
// hold a bucket in debt, or a fixed window is paused), and RetryAfter then
// says for how long. See the package doc for how this and the rest compare
// with golang.org/x/time/rate and redis_rate. A limiter with a Concurrency
// rule refuses AllowN with a *ConfigError naming the rule: take a place
// with Wait or Admit.
func (l *Limiter) AllowN(ctx context.Context, subject string, n int) (Result, error) {
	if err := l.open(); err != nil {
		return Result{}, err
	}
	return l.mode.allow(ctx, subject, n)
}

// ReserveN books n permits for subject at the earliest time every rule
// can grant them, in one round trip, and returns the reservation: the
// caller must wait Delay before acting, or Cancel it. Every algorithm can
// reserve: the windows book into their ledger of future admissions (each
// algorithm's Lua file says how).
//
// The booking is bounded by the context's deadline and by MaxWait: if the
// slot is later, nothing is booked and a *DelayError says when it would
// be (errors.Is(err, context.DeadlineExceeded) when the deadline bounded
// it). n = 0 charges nothing and has nothing to cancel; as in x/time/rate
// it is granted at once, or, while reservations hold a bucket in debt,
// when the debt is repaid.
func (l *Limiter) ReserveN(ctx context.Context, subject string, n int) (*Reservation, error) {
	if err := l.open(); err != nil {
		return nil, err
	}
	return l.mode.acquire(ctx, subject, n, true)
}

// reserve is ReserveN's one script call.
func (l *Limiter) reserve(ctx context.Context, subject string, n int) (*Reservation, error) {
	return l.reserveCosts(ctx, subject, n, nil)
}

// reserveCosts is reserve of n permits with costs per rule (nil: n under
// every rule).
func (l *Limiter) reserveCosts(ctx context.Context, subject string, n int, per Costs) (*Reservation, error) {
	bound, byDeadline := l.waitBound(ctx, time.Now())
	res, r, err := l.decide(ctx, opReserve, subject, n, micros(bound), true, per)
	if err != nil {
		return nil, err
	}
	if !res.Allowed {
		return nil, &DelayError{Rule: res.Rule, RetryAfter: res.RetryAfter, Deadline: byDeadline}
	}
	return r, nil
}

// reserveAt is reserve of n permits at a turn no earlier than notBefore
// (µs of Redis time), charged to every rule at that turn (lua/allow.lua:
// meet): a part of a limiter over several subjects meeting the others'
// turn (subjects.go). Its bound and failures are reserve's.
func (l *Limiter) reserveAt(ctx context.Context, subject string, n int, notBefore int64) (*Reservation, error) {
	bound, byDeadline := l.waitBound(ctx, time.Now())
	line, err := l.line(opMeet, subject, n, micros(bound))
	if err != nil {
		return nil, err
	}
	line[lineHead+len(l.rules)+2] = strconv.FormatInt(micros(bound), 10) + " " + strconv.FormatInt(notBefore, 10)
	res, r, err := l.askLine(ctx, opMeet, subject, n, true, nil, line)
	if re, ok := err.(*redisError); ok {
		return l.failOpenOr(ctx, opMeet, subject, n, re.err)
	}
	if err != nil {
		return nil, err
	}
	if !res.Allowed {
		return nil, &DelayError{Rule: res.Rule, RetryAfter: res.RetryAfter, Deadline: byDeadline}
	}
	return r, nil
}

// Wait blocks until one permit for subject is granted. It is
// WaitN(ctx, subject, 1).
func (l *Limiter) Wait(ctx context.Context, subject string) error {
	return l.WaitN(ctx, subject, 1)
}

// WaitN blocks until n permits for subject are granted, or fails.
//
// For token bucket and GCRA limiters it reserves the earliest slot in one
// round trip and sleeps until it; waiters are served in the order Redis
// booked them. For window rules, waiters on one subject queue in this
// process, first come first served, and only the first asks Redis, at the
// exact time the script says a permit frees.
//
// It fails at once, consuming nothing, with a *DelayError if the permits
// would come after the context's deadline (the error then matches
// context.DeadlineExceeded) or after MaxWait (Deadline false). If the
// context ends while waiting, the reservation is refunded and ctx.Err()
// returned. n larger than a rule's capacity is an error matching ErrExceedsCapacity. n = 0
// charges nothing: it returns at once unless a request of 0 would wait
// (see AllowN), and then waits as x/time/rate's WaitN(ctx, 0) does.
//
// With a Concurrency rule, WaitN takes a place, which the caller gives
// back: Acquire is WaitN that hands it back as a value to release.
func (l *Limiter) WaitN(ctx context.Context, subject string, n int) error {
	_, err := l.Acquire(ctx, subject, n)
	return err
}

// Acquire is WaitN that returns the place it took of the limiter's
// Concurrency rule: hold it while the work runs and give it back with
// Place.Release when the work ends, whether it succeeded or not. Without
// a Concurrency rule (or when a FailOpen limiter admitted without Redis)
// it takes no place and returns a nil *Place, whose Release does
// nothing. Errors are WaitN's.
func (l *Limiter) Acquire(ctx context.Context, subject string, n int) (*Place, error) {
	if err := l.open(); err != nil {
		return nil, err
	}
	return l.mode.wait(ctx, subject, n)
}

// acquire books n permits: a reservation for bucket limiters, or, for
// window limiters, the permits themselves once the local queue and Redis
// grant them. It does not sleep until a reservation's time to act.
func (l *Limiter) acquire(ctx context.Context, subject string, n int) (*Reservation, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return l.mode.acquire(ctx, subject, n, false)
}

// acquireAndWait books n permits and sleeps until their time to act.
func (l *Limiter) acquireAndWait(ctx context.Context, subject string, n int) error {
	r, err := l.acquire(ctx, subject, n)
	if err != nil {
		return err
	}
	return r.wait(ctx)
}

// micros converts a wait bound (negative: none) for the script.
func micros(bound time.Duration) int64 {
	if bound < 0 {
		return unbounded
	}
	return bound.Microseconds()
}

// waitBound returns how long a request may wait from now: the tighter of
// MaxWait and the context's deadline, -1 if neither is set, and whether the
// deadline is the tighter.
func (l *Limiter) waitBound(ctx context.Context, now time.Time) (time.Duration, bool) {
	bound, byDeadline := time.Duration(-1), false
	if l.opts.MaxWait > 0 {
		bound = l.opts.MaxWait
	}
	if dl, ok := ctx.Deadline(); ok {
		if left := max(dl.Sub(now), 0); bound < 0 || left < bound {
			bound, byDeadline = left, true
		}
	}
	return bound, byDeadline
}

// call runs one call of the limiter's script for o and parses the reply,
// noting when it came back.
func (l *Limiter) call(ctx context.Context, o op, keys []string, args []any) (reply, time.Time, error) {
	return l.callLine(ctx, o, evalLine(keys, args))
}

// callLine is call of a script call's line (run.go).
func (l *Limiter) callLine(ctx context.Context, o op, line []any) (reply, time.Time, error) {
	cmd := l.run(ctx, l.scripts.of(o), line)
	err := l.result(ctx, o, cmd.Err())
	recv := time.Now()
	if err != nil {
		return reply{}, recv, err
	}
	raw, err := cmd.Slice()
	if err != nil {
		return reply{}, recv, err
	}
	rep, err := l.parse(raw)
	return rep, recv, err
}

// decide runs one allow or reserve decision of n permits, with costs per
// rule per (nil: n under every rule). On success with ok=1 and keep
// it also returns the reservation holding the refund tickets. If Redis
// fails, a fail-open limiter admits (a reservation without tickets).
func (l *Limiter) decide(ctx context.Context, o op, subject string, n int, bound int64, keep bool, per Costs) (Result, *Reservation, error) {
	res, r, err := l.ask(ctx, o, subject, n, bound, keep, per)
	if re, ok := err.(*redisError); ok {
		r, err := l.failOpenOr(ctx, o, subject, n, re.err)
		if err != nil {
			return Result{}, nil, err
		}
		return Result{Allowed: true, Rule: l.rules[0].Name, Limit: l.rules[0].Limit}, r, nil
	}
	return res, r, err
}

// failOpenOr answers a request for o that Redis failed with cause:
// admitted without Redis if the limiter fails open, else a *redisError.
func (l *Limiter) failOpenOr(ctx context.Context, o op, subject string, n int, cause error) (*Reservation, error) {
	if l.redisFailed(ctx, cause) {
		return &Reservation{lim: l, subject: subject, n: n, at: time.Now()}, nil
	}
	return nil, &redisError{op: o, err: cause}
}

// costLine is line (policy.go), or with costs per rule per, their call's
// line.
func (l *Limiter) costLine(o op, subject string, n int, per Costs, bound int64) ([]any, error) {
	if per == nil {
		return l.line(o, subject, n, bound)
	}
	keys, args, err := l.requestCosts(o, subject, n, per, bound, nil)
	if err != nil {
		return nil, err
	}
	return evalLine(keys, args), nil
}

// ask is decide without FailOpen: a Redis failure is a *redisError.
// Without keep (AllowN, which drops the reservation) it builds none: the
// hot path of Allow allocates only what go-redis needs.
func (l *Limiter) ask(ctx context.Context, o op, subject string, n int, bound int64, keep bool, per Costs) (Result, *Reservation, error) {
	line, err := l.costLine(o, subject, n, per, bound)
	if err != nil {
		return Result{}, nil, err
	}
	return l.askLine(ctx, o, subject, n, keep, per, line)
}

// askLine is ask of a line already built.
func (l *Limiter) askLine(ctx context.Context, o op, subject string, n int, keep bool, per Costs, line []any) (Result, *Reservation, error) {
	var err error
	var rep reply
	var recv time.Time
	if o == opAllow && !keep {
		if fastScript(l.scripts.allow, line) != nil {
			// The caller keeps only the Result: the fast script answers
			// in one integer.
			line[lineHead+1] = answerOnly
		}
		var raw any
		raw, err = l.runAllow(ctx, line)
		if err = l.result(ctx, o, err); err == nil {
			rep, err = l.parseAllow(raw, n)
		}
	} else {
		rep, recv, err = l.callLine(ctx, o, line)
	}
	if err != nil {
		return Result{}, nil, err
	}
	res := rep.Result
	if !res.Allowed {
		return res, nil, nil
	}
	delay := res.RetryAfter
	if o == opAllow {
		res.RetryAfter = 0
	}
	if !keep {
		return res, nil, nil
	}
	r := &Reservation{lim: l, subject: subject, n: n, per: per, tickets: rep.tickets(len(l.rules)), delay: delay, at: recv, booked: rep.redisNow}
	if o != opAllow {
		// allow's permits are now: they need no wake time and skip the
		// clock estimator's lock.
		r.at = l.clock.wake(recv, rep.redisNow, delay)
	}
	return res, r, nil
}
