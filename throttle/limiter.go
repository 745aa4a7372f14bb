package throttle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	OnRedisError func(err error, failedOpen bool)
	// NoBatching sends every AllowN as its own EVALSHA. By default,
	// concurrent AllowN calls of one Limiter go out together in one
	// pipeline (batch.go): a lone call is still sent at once, on its own,
	// but many goroutines calling Allow cost the client and Redis one
	// write and one read per batch instead of per call. A go-redis hook
	// sees a batch in ProcessPipelineHook, not in ProcessHook.
	NoBatching bool
	// LocalLease, if above zero, serves one hot subject past what one
	// Redis shard can decide (about 40,000 script calls a second): where
	// this process's own demand for a subject is high, Allow and Wait hand
	// out permits from runs of the bucket's slots leased from Redis in one
	// call, in arrival order, each no earlier than its slot on the Redis
	// clock and at most LocalLease after it (leased.go). In any window,
	// admissions then exceed the exact bound (Burst + Rate × window) by at
	// most Rate × LocalLease: 5ms is at most 0.5 % of a per-second limit.
	// Where demand is low (a few per second) every call goes to Redis as
	// without it, exactly. It needs exactly one TokenBucket or GCRA rule,
	// and at most a tenth of its Period (else a *ConfigError). Reserve,
	// Admit, PrepayN, AllowAtMost, Groups and Transport do not lease. If
	// zero (the default), nothing is leased.
	LocalLease time.Duration
}

// A Limiter decides, through Redis, whether a subject (a tenant, an API
// key, a host) may go ahead under one or more rules. Every rule of the
// limiter is checked and charged together, in one atomic script call: a
// denied request charges no rule. Limiters on different machines that use
// the same Redis, prefix and rules share their limits.
//
// A Limiter is safe for concurrent use.
type Limiter struct {
	rdb        redis.UniversalClient
	rules      []Rule
	opts       Options
	prefix     string
	keyRules   []string // escaped rule names, the last part of each key
	ruleArgs   []any    // per rule: algorithm, count, period µs, extra; a ticket follows each
	script     *redis.Script
	reservable bool

	failingOpen atomic.Bool
	cache       scriptCache

	clock  redisClock   // maps Redis TIME to local time for waking (clock.go)
	batch  allowBatcher // concurrent AllowN calls sent together (batch.go)
	leases *leaser      // Options.LocalLease (leased.go); nil if off

	mu      sync.Mutex
	queues  map[string]*waitQueue   // window waits, by encoded subject
	refunds map[string]*refundBatch // refunds waiting for a call, by escaped subject; undos apart
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
	l := &Limiter{
		rdb:        rdb,
		rules:      append([]Rule(nil), rules...),
		opts:       opts,
		prefix:     opts.Prefix,
		script:     scriptFor(rules),
		reservable: true,
		queues:     map[string]*waitQueue{},
		refunds:    map[string]*refundBatch{},
	}
	if l.prefix == "" {
		l.prefix = DefaultPrefix
	}
	if l.opts.Logger == nil {
		l.opts.Logger = slog.Default()
	}
	seen := map[string]bool{}
	for _, r := range rules {
		if err := r.Validate(); err != nil {
			return nil, err
		}
		if seen[r.Name] {
			return nil, &ConfigError{Rule: r.Name, Field: "name", Reason: "is used by two rules of one limiter; rule names must be unique"}
		}
		seen[r.Name] = true
		spec := r.Algorithm.spec()
		extra := int64(r.Limit.Burst)
		if spec.extra != nil {
			extra = spec.extra(r)
		}
		count, period := int64(r.Limit.Count), r.Limit.Period.Microseconds()
		if spec.bucket {
			count, period = lowestTerms(count, period) // bucket.lua: exact times
		}
		l.keyRules = append(l.keyRules, escape(r.Name))
		l.ruleArgs = append(l.ruleArgs, r.Algorithm.String(), count, period, extra)
		l.reservable = l.reservable && r.Algorithm.bucket()
	}
	var err error
	if l.leases, err = newLeaser(l, opts); err != nil {
		return nil, err
	}
	return l, nil
}

// Rules returns a copy of the limiter's rules.
func (l *Limiter) Rules() []Rule { return append([]Rule(nil), l.rules...) }

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
// none otherwise. It never waits. It returns a *CapacityError if n is
// more than a rule can ever admit at once, and an error matching ErrRedis
// if Redis fails (unless FailOpen, which allows).
//
// n = 0 is the state read, for every algorithm: it charges nothing and
// reports Remaining and ResetAfter under every rule. Allowed is false
// only while a request of 0 would have to wait (reservations or a pause
// hold a bucket in debt, or a fixed window is paused), and RetryAfter then
// says for how long. See the package doc for how this and the rest compare
// with golang.org/x/time/rate and redis_rate.
func (l *Limiter) AllowN(ctx context.Context, subject string, n int) (Result, error) {
	if l.leases != nil {
		if res, ok, err := l.leases.allow(ctx, subject, n); ok {
			return res, err
		}
	}
	res, _, err := l.decide(ctx, "allow", subject, n, -1, false)
	return res, err
}

// Reserve is ReserveN(ctx, subject, 1).
func (l *Limiter) Reserve(ctx context.Context, subject string) (*Reservation, error) {
	return l.ReserveN(ctx, subject, 1)
}

// ReserveN books n permits for subject at the earliest time every rule
// can grant them, in one round trip, and returns the reservation: the
// caller must wait Delay before acting, or Cancel it. Only limiters whose
// rules are all TokenBucket or GCRA can reserve (else ErrNotReservable).
//
// The booking is bounded by the context's deadline and by MaxWait: if the
// slot is later, nothing is booked and a *DelayError says when it would
// be (errors.Is(err, context.DeadlineExceeded) when the deadline bounded
// it). n = 0 charges nothing and has nothing to cancel; as in x/time/rate
// it is granted at once, or, while reservations hold a bucket in debt,
// when the debt is repaid.
func (l *Limiter) ReserveN(ctx context.Context, subject string, n int) (*Reservation, error) {
	if !l.reservable {
		return nil, ErrNotReservable
	}
	bound, byDeadline := l.waitBound(ctx, time.Now())
	maxWait := int64(-1)
	if bound >= 0 {
		maxWait = bound.Microseconds()
	}
	res, r, err := l.decide(ctx, "reserve", subject, n, maxWait, true)
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
// context.DeadlineExceeded) or after MaxWait (matching ErrMaxWait). If the
// context ends while waiting, the reservation is refunded and ctx.Err()
// returned. n larger than a rule's capacity is a *CapacityError. n = 0
// charges nothing: it returns at once unless a request of 0 would wait
// (see AllowN), and then waits as x/time/rate's WaitN(ctx, 0) does.
func (l *Limiter) WaitN(ctx context.Context, subject string, n int) error {
	if l.leases != nil {
		if ok, err := l.leases.wait(ctx, subject, n); ok {
			return err
		}
	}
	r, err := l.acquire(ctx, subject, n)
	if err != nil {
		return err
	}
	return r.wait(ctx)
}

// acquire books n permits: a reservation for bucket limiters, or, for
// window limiters, the permits themselves once the local queue and Redis
// grant them. It does not sleep until a reservation's time to act.
func (l *Limiter) acquire(ctx context.Context, subject string, n int) (*Reservation, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if l.reservable {
		return l.ReserveN(ctx, subject, n)
	}
	return l.waitWindow(ctx, subject, n)
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

// noBound is maxWait -1 (no bound), boxed once: boxing an int64 outside
// 0..255 allocates, and allow sends it on every call.
var noBound any = int64(-1)

// request is one call's keys and arguments.
func (l *Limiter) request(op, subject string, n int, maxWait int64, tickets []string) ([]string, []any, error) {
	if n < 0 {
		return nil, nil, fmt.Errorf("throttle: n = %d permits: must not be negative (0 reads the state)", n)
	}
	for _, r := range l.rules {
		if c := r.Limit.capacity(r.Algorithm); n > c {
			return nil, nil, &CapacityError{Rule: r.Name, N: n, Capacity: c}
		}
	}
	enc, err := EncodeSubject(subject)
	if err != nil {
		return nil, nil, err
	}
	keys := make([]string, len(l.rules))
	args := make([]any, 3, 3+5*len(l.rules))
	args[0], args[1], args[2] = op, n, noBound
	if maxWait != -1 {
		args[2] = maxWait
	}
	for i := range l.rules {
		keys[i] = key(l.prefix, enc, l.keyRules[i])
		ticket := ""
		if tickets != nil {
			ticket = tickets[i]
		}
		args = append(append(args, l.ruleArgs[4*i:4*i+4]...), ticket)
	}
	return keys, args, nil
}

// decide runs one allow or reserve decision. On success with ok=1 and keep
// it also returns the reservation holding the refund tickets. If Redis
// fails, a fail-open limiter admits (a reservation without tickets).
func (l *Limiter) decide(ctx context.Context, op, subject string, n int, maxWait int64, keep bool) (Result, *Reservation, error) {
	res, r, err := l.ask(ctx, op, subject, n, maxWait, keep)
	if re, ok := err.(*redisError); ok {
		r, err := l.failOpenOr(ctx, op, subject, n, re.err)
		if err != nil {
			return Result{}, nil, err
		}
		return Result{Allowed: true, Rule: l.rules[0].Name, Limit: l.rules[0].Limit}, r, nil
	}
	return res, r, err
}

// failOpenOr answers a request that Redis failed with cause: admitted
// without Redis if the limiter fails open, else a *redisError.
func (l *Limiter) failOpenOr(ctx context.Context, op, subject string, n int, cause error) (*Reservation, error) {
	if l.redisFailed(ctx, cause) {
		return &Reservation{lim: l, subject: subject, n: n, at: time.Now()}, nil
	}
	return nil, &redisError{op: op, err: cause}
}

// ask is decide without FailOpen: a Redis failure is a *redisError.
// Without keep (AllowN, which drops the reservation) it builds none: the
// hot path of Allow allocates only what go-redis needs.
func (l *Limiter) ask(ctx context.Context, op, subject string, n int, maxWait int64, keep bool) (Result, *Reservation, error) {
	keys, args, err := l.request(op, subject, n, maxWait, nil)
	if err != nil {
		return Result{}, nil, err
	}
	var reply []any
	if op == "allow" && !keep {
		reply, err = l.runAllow(ctx, keys, args)
	} else {
		reply, err = l.run(ctx, l.script, keys, args...).Slice()
	}
	recv := time.Now()
	if err != nil {
		return Result{}, nil, &redisError{op: op, err: err}
	}
	l.redisOK()
	res, redisNow, err := l.parse(reply)
	if err != nil {
		return Result{}, nil, err
	}
	if !res.Allowed {
		return res, nil, nil
	}
	delay := res.RetryAfter
	if op == "allow" {
		res.RetryAfter = 0
	}
	if !keep {
		return res, nil, nil
	}
	r := &Reservation{lim: l, subject: subject, n: n, tickets: tickets(reply), delay: delay, at: recv}
	if op != "allow" {
		// allow's permits are now: they need no wake time and skip the
		// clock estimator's lock.
		r.at = l.clock.wake(recv, redisNow, delay)
	}
	return res, r, nil
}

// parse reads the driver's reply (see lua/driver.lua): the result and
// Redis's now (µs of Redis TIME). tickets reads the refund tickets.
func (l *Limiter) parse(reply []any) (Result, int64, error) {
	if len(reply) != 6 && len(reply) != 6+len(l.rules) {
		return Result{}, 0, badReply(reply)
	}
	var ints [6]int64
	for i := range ints {
		v, ok := reply[i].(int64)
		if !ok {
			return Result{}, 0, badReply(reply)
		}
		ints[i] = v
	}
	decider := int(ints[1]) - 1
	if decider < 0 || decider >= len(l.rules) {
		return Result{}, 0, badReply(reply)
	}
	return Result{
		Allowed:    ints[0] == 1,
		Rule:       l.rules[decider].Name,
		Limit:      l.rules[decider].Limit,
		Remaining:  int(ints[2]),
		RetryAfter: time.Duration(ints[3]) * time.Microsecond,
		ResetAfter: time.Duration(ints[4]) * time.Microsecond,
	}, ints[5], nil
}

// tickets returns the refund tickets of an admitted reply, one per rule;
// nil if it has none (n = 0 charged nothing).
func tickets(reply []any) []string {
	if len(reply) <= 6 {
		return nil
	}
	t := make([]string, 0, len(reply)-6)
	for _, v := range reply[6:] {
		s, _ := v.(string)
		t = append(t, s)
	}
	return t
}

// badReply is the error for a reply the driver cannot have sent (built only
// then: formatting a reply costs more than the rest of parsing it).
func badReply(reply []any) error {
	return fmt.Errorf("throttle: unexpected script reply %v", reply)
}

// redisFailed reports a Redis error and whether to admit anyway.
func (l *Limiter) redisFailed(ctx context.Context, err error) bool {
	open := l.opts.FailOpen && ctx.Err() == nil
	if open && !l.failingOpen.Swap(true) {
		l.opts.Logger.Warn("throttle: Redis unreachable, admitting requests (fail open)", "prefix", l.prefix, "error", err)
	}
	if l.opts.OnRedisError != nil {
		l.opts.OnRedisError(err, open)
	}
	return open
}

// redisOK notes that Redis answered, ending a fail-open period.
func (l *Limiter) redisOK() {
	if l.failingOpen.Load() && l.failingOpen.Swap(false) {
		l.opts.Logger.Info("throttle: Redis answers again, limits apply", "prefix", l.prefix)
	}
}

// refund gives back the permits of a reservation. Refunds of one subject
// are sent together: one goroutine per subject makes the calls, each with
// every refund that arrived while the previous call was out (up to
// maxRefundBatch), so a storm of cancellations (a shutdown, a batch timing
// out) costs a few round trips instead of one each, and does not queue for
// the client's connections until the refunds time out. It returns when its
// refund is made, or when ctx ends; the refund is then still made if Redis
// answers. undo (a Group rolling back a part) gives the permits back even
// after their time to act, which a Cancel does not (bucket.lua).
func (l *Limiter) refund(ctx context.Context, subject string, n int, tickets []string, undo bool) error {
	if _, _, err := l.request("refund", subject, n, -1, tickets); err != nil {
		return err // bad input fails before it is queued
	}
	e := &refundEntry{ctx: ctx, n: n, tickets: tickets, done: make(chan struct{})}
	// Cancels and undos of one subject go in separate batches (one op per
	// call). An escaped subject holds no NUL, so the undo key, with a NUL
	// in front, is never another subject's.
	batchKey := escape(subject)
	if undo {
		batchKey = "\x00" + batchKey
	}
	l.mu.Lock()
	b, flushing := l.refunds[batchKey]
	if !flushing {
		b = &refundBatch{undo: undo}
		l.refunds[batchKey] = b
	}
	b.pending = append(b.pending, e)
	l.mu.Unlock()
	if !flushing {
		go l.flushRefunds(batchKey, subject, b)
	}
	select {
	case <-e.done:
		return e.err
	case <-ctx.Done():
		return &redisError{op: "refund", err: ctx.Err()}
	}
}

// maxRefundBatch bounds the reservations one refund call gives back, and
// so how long that script holds Redis.
const maxRefundBatch = 256

// refundBatch holds the refunds of one subject waiting for a call.
type refundBatch struct {
	pending []*refundEntry
	undo    bool // op 'undo' rather than 'refund'
}

// refundEntry is one reservation to give back.
type refundEntry struct {
	ctx     context.Context // its caller's, for values; the call has its own deadline
	n       int
	tickets []string
	done    chan struct{} // closed once err is set
	err     error
}

// flushRefunds sends subject's pending refunds until there are none left;
// batchKey is b's key in l.refunds.
func (l *Limiter) flushRefunds(batchKey, subject string, b *refundBatch) {
	for {
		l.mu.Lock()
		batch := b.pending[:min(len(b.pending), maxRefundBatch)]
		b.pending = b.pending[len(batch):]
		if len(batch) == 0 {
			delete(l.refunds, batchKey)
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		err := l.refundNow(subject, batch, b.undo)
		for _, e := range batch {
			e.err = err
			close(e.done)
		}
	}
}

// refundNow gives back every reservation of batch in one script call,
// bounded by refundTimeout.
func (l *Limiter) refundNow(subject string, batch []*refundEntry, undo bool) error {
	first := batch[0]
	op := "refund"
	if undo {
		op = "undo"
	}
	keys, args, err := l.request(op, subject, first.n, -1, first.tickets)
	if err != nil {
		return err
	}
	// The pause key, so that the script can hold a running pause (pause.go),
	// then each rule's record of cancelled reservations, so that refunds
	// arriving in any order give back everything (prelude.lua); the other
	// reservations follow the rules in ARGV (driver.lua).
	keys = append(keys, l.pauseKey(subject))
	enc := escape(subject)
	for _, r := range l.keyRules {
		keys = append(keys, key(l.prefix, enc, r+cancelledSuffix))
	}
	for _, e := range batch[1:] {
		args = append(args, e.n)
		for _, t := range e.tickets {
			args = append(args, t)
		}
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(first.ctx), refundTimeout)
	defer cancel()
	if err := l.run(ctx, l.script, keys, args...).Err(); err != nil {
		// A cancelled Wait drops this error (it returns ctx.Err()), so the
		// hook is where a refund lost to Redis shows: once per refund.
		if l.opts.OnRedisError != nil {
			for range batch {
				l.opts.OnRedisError(err, false)
			}
		}
		return &redisError{op: "refund", err: err}
	}
	return nil
}

// String lists the limiter's rules.
func (l *Limiter) String() string {
	parts := make([]string, len(l.rules))
	for i, r := range l.rules {
		parts[i] = r.String()
	}
	return "throttle.Limiter{" + strings.Join(parts, "; ") + "}"
}
