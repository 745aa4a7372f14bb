package throttle

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// The scripts' arguments: one type per script, each building the KEYS and
// ARGV its lua/<operation>.lua header documents, in the order it reads
// them; replies.go decodes what they answer. allow.lua's (allow, reserve,
// atmost) are policy.build's line (policy.go), built in one allocation
// because Allow is the hot path, in bucket_fast.lua's shorter form where
// that script decides the call (scripts.go). Each type's build starts from
// policy.request, the rules' part every policy script shares
// (lua/rules.lua).

// prepayArgs is one call of lua/prepay.lua: a reserve of n permits for
// subject within bound µs (unbounded: none) that records receipt (an id,
// made a member of the receipt set), kept keep after its slot and no
// sooner than after from now.
type prepayArgs struct {
	subject     string
	n           int
	per         Costs // the costs per rule, if they differ (nil: n under every rule)
	bound       int64
	receipt     string
	keep, after time.Duration
}

func (a prepayArgs) build(p *policy) ([]string, []any, error) {
	keys, args, err := p.requestCosts(opPrepay, a.subject, a.n, a.per, a.bound, nil)
	if err != nil {
		return nil, nil, err
	}
	keys = append(keys, p.receiptsKey(a.subject), p.ticketsKey(a.subject))
	args = append(args, p.member(a.receipt), a.keep.Microseconds(), a.after.Microseconds())
	return keys, args, nil
}

// nArg is e's permits as refund.lua reads them: n, or its costs per rule.
func (e *refundEntry) nArg() any {
	if e.per != nil {
		return e.per.arg()
	}
	return e.n
}

// refundArgs is one call of lua/refund.lua: the reservations of batch
// (at least one) given back for subject; undo gives back even after
// their time to act.
type refundArgs struct {
	subject string
	undo    bool
	batch   []*refundEntry
}

func (a refundArgs) op() op {
	if a.undo {
		return opUndo
	}
	return opRefund
}

func (a refundArgs) build(p *policy) ([]string, []any, error) {
	first := a.batch[0]
	keys, args, err := p.requestCosts(a.op(), a.subject, first.n, first.per, first.booked, first.tickets)
	if err != nil {
		return nil, nil, err
	}
	// Each rule's record of cancelled reservations, so that refunds
	// arriving in any order give back everything (prelude.lua); the other
	// reservations follow the rules in ARGV.
	keys = append(keys, p.givebackKeys(a.subject, cancelledSuffix)...)
	// With a turn under a share limit in the batch, the shares' caps,
	// and a share ticket for each reservation after its booking time.
	shares := slices.ContainsFunc(a.batch, func(e *refundEntry) bool { return e.share != "" })
	if shares {
		keys = append(keys, p.lineKeys(a.subject)[lineCapsKey])
		args = append(args, first.share)
	}
	for _, e := range a.batch[1:] {
		args = append(args, e.nArg(), e.booked)
		if shares {
			args = append(args, e.share)
		}
		for _, t := range e.tickets {
			args = append(args, t)
		}
	}
	return keys, args, nil
}

// settleArgs is one call of lua/settle.lua: the reservation of n permits
// (per rule: per, if not nil) for subject, made at the Redis time booked
// (µs) with tickets, settled to actual permits (per rule: actualPer, if
// not nil).
type settleArgs struct {
	subject        string
	n, actual      int
	per, actualPer Costs
	tickets        []string
	booked         int64
}

func (a settleArgs) build(p *policy) ([]string, []any, error) {
	keys, args, err := p.requestCosts(opSettle, a.subject, a.n, a.per, int64(a.actual), a.tickets)
	if err != nil {
		return nil, nil, err
	}
	if a.actualPer != nil {
		args[2] = a.actualPer.arg()
	}
	// Each rule's record of give-backs (bucket_rare.lua); after the rules,
	// when the reservation was made.
	keys = append(keys, p.givebackKeys(a.subject, settledSuffix)...)
	keys = append(keys, p.limitsKey(a.subject)) // lua/limits_pace.lua
	args = append(args, a.booked)
	return keys, args, nil
}

// pauseArgs is one call of lua/pause.lua: subject paused for us µs.
type pauseArgs struct {
	subject string
	us      int64
}

func (a pauseArgs) build(p *policy) ([]string, []any, error) {
	keys, args, err := p.request(opPause, a.subject, 1, a.us, nil)
	if err != nil {
		return nil, nil, err
	}
	return append(keys, p.pauseKey(a.subject)), args, nil
}

// admitArgs is one call of lua/admit.lua, whose header documents its
// KEYS and ARGV: keys and args, and what the decoder needs of the request.
type admitArgs struct {
	keys    []string
	args    []any
	who     who
	serving bool // N = 0 without a Concurrency rule: a serving of the line
}

// admitCall checks req and builds its call of lua/admit.lua; it may give
// req.ShareLimit a zero Burst's default.
func (l *Limiter) admitCall(req *AdmitRequest) (admitArgs, error) {
	serving, horizon, err := l.checkAdmit(req)
	if err != nil {
		return admitArgs{}, err
	}
	wait := micros(req.Wait)
	keys, args, err := l.requestCosts(opAdmit, req.Subject, req.N, req.Costs, wait, nil)
	if err != nil {
		return admitArgs{}, err
	}
	w, err := req.Caller.resolve(l)
	if err != nil {
		return admitArgs{}, err
	}
	keys = append(keys, l.receiptsKey(req.Subject), l.pauseKey(req.Subject), l.ticketsKey(req.Subject))
	keys = append(keys, l.lineKeys(req.Subject)...)
	keys = append(keys, l.upstreamKey(req.Subject), l.limitsKey(req.Subject), l.departuresKey(req.Subject)) // lua/upstream_pace.lua, lua/limits_pace.lua, lua/upstream_rate.lua
	// Each rule's record of give-backs: a lapsed turn's (lua/rules.lua: lapse_turn).
	keys = append(keys, l.settledKeys(req.Subject)...)
	early := wait
	if req.EarlyWait > 0 {
		early = req.EarlyWait.Microseconds()
	}
	var hz any = horizon
	if l.headsServe(*req) {
		hz = fmt.Sprintf("%d h", horizon) // lua/admit.lua: the members serve the line
	}
	args = append(args, w.booking, req.toleranceArg(), hz, early, w.waiter, w.waitAs, req.Share, req.Caller.lineArg(req.maxAge(horizon)))
	if sl := req.ShareLimit; sl != (Limit{}) && horizon != unbounded {
		args = append(args, sl.Count, sl.Period.Microseconds(), sl.Burst)
	} else {
		args = append(args, 0, 0, 0)
	}
	for _, m := range w.redeem {
		args = append(args, m)
	}
	return admitArgs{keys: keys, args: args, who: w, serving: serving}, nil
}

// headsServe reports whether req's line is served by its members
// (AdmitRequest.HeadServes): not with a share limit, nor without a line.
func (l *Limiter) headsServe(req AdmitRequest) bool {
	return req.HeadServes && req.Horizon > 0 && !l.holders && req.ShareLimit == (Limit{})
}

// checkAdmit checks req's bounds and share limit, and returns whether it
// serves the line and the horizon in µs (unbounded: none).
func (l *Limiter) checkAdmit(req *AdmitRequest) (serving bool, horizon int64, err error) {
	if err := req.Caller.check(); err != nil {
		return false, 0, err
	}
	serving = req.N == 0 && !l.holders
	if serving && req.Horizon <= 0 {
		return false, 0, errors.New("throttle: admit: n = 0 serves the subject's line, which needs a Horizon")
	}
	if req.Horizon < 0 || req.Horizon > maxPeriod {
		return false, 0, fmt.Errorf("throttle: admit: horizon %v: must be between 0 (no bound) and %v", req.Horizon, maxPeriod)
	}
	horizon = unbounded
	if req.Horizon > 0 && !l.holders {
		horizon = req.Horizon.Microseconds()
	}
	if req.MaxAge < 0 || req.MaxAge > maxPeriod || req.MaxAge%time.Microsecond != 0 {
		return false, 0, fmt.Errorf("throttle: admit: max age %v: must be a whole number of microseconds from 0 (the default) to %v", req.MaxAge, maxPeriod)
	}
	if err := l.checkNotBefore(req, horizon); err != nil {
		return false, 0, err
	}
	if req.ShareLimit != (Limit{}) {
		if req.Priority > 0 {
			return false, 0, errors.New("throttle: admit: a share limit and a priority cannot be combined: a share its own limit holds back is served by its position in its share, not its level; drop one")
		}
		if err := l.checkShareLimit(req, horizon); err != nil {
			return false, 0, err
		}
	}
	return serving, horizon, nil
}

// admitCosts turns req.Costs into the request it is (Limiter.costs): N
// their largest, and Costs nil if every rule is charged N. They must not
// all be 0 (N = 0 serves the line), nor come with N or a ShareLimit.
func (l *Limiter) admitCosts(req *AdmitRequest) error {
	if req.Costs == nil {
		return nil
	}
	if req.N != 0 {
		return errors.New("throttle: admit: give N or Costs, not both")
	}
	n, per, err := l.costs(req.Costs)
	if err != nil {
		return err
	}
	if n == 0 {
		return errors.New("throttle: admit: every cost is 0; give at least one rule a cost (N = 0 serves the line)")
	}
	if per != nil && req.ShareLimit != (Limit{}) {
		return errors.New("throttle: admit: a share limit takes one N; different costs per rule cannot have one")
	}
	req.N, req.Costs = n, per
	return nil
}

// checkNotBefore checks req.NotBefore, if set: it needs bucket rules (a
// turn at a given time is a TAT moved to it, bucket.lua), no line and no
// share limit.
func (l *Limiter) checkNotBefore(req *AdmitRequest, horizon int64) error {
	if req.NotBefore.IsZero() {
		return nil
	}
	for _, r := range l.rules {
		if r.Algorithm != GCRA && r.Algorithm != TokenBucket {
			return fmt.Errorf("throttle: admit: not before: rule %q is %s; a turn no earlier than a given time needs the bucket algorithms (gcra, token_bucket)", r.Name, r.Algorithm)
		}
	}
	if horizon != unbounded || req.ShareLimit != (Limit{}) {
		return errors.New("throttle: admit: not before: a turn at a given time is booked outside the subject's line; give no Horizon and no ShareLimit")
	}
	return nil
}

// toleranceArg is ARGV[b+1] of lua/admit.lua: the tolerance in µs (at
// least 1), or "tolerance not_before" with NotBefore in µs of Redis time.
func (req *AdmitRequest) toleranceArg() any {
	tol := max(req.Tolerance.Microseconds(), 1)
	if req.NotBefore.IsZero() {
		return tol
	}
	return fmt.Sprintf("%d %d", tol, max(req.NotBefore.UnixMicro(), 0))
}
