package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
)

// Several costs, one decision. A policy whose rules count different
// things for one task (requests 1, input tokens 900, output tokens 400 for
// one LLM call) charges each rule its own cost in the one script call that
// decides them all, all or nothing, and settles each to the real count
// afterwards. The scripts take the costs in ARGV[2], one number per rule
// (lua/rules.lua, per_rule); a single n is still sent as one number, so
// the calls of a single-n request, the hot path of Allow included, are
// unchanged.

// Costs is what one request takes under each rule of a limiter, in the
// order of Limiter.Rules: permits for a rate rule. Costs{1, 900, 400}
// charges a policy of requests, input tokens and output tokens for one
// LLM call. A rule whose cost is 0 is neither checked nor charged: it
// does not delay or deny the request. Costs whose entries are all equal
// to n are the single-n request (AllowN, ReserveN, AdmitRequest.N), and
// go the same way.
type Costs []int

// arg is c as ARGV[2] (lua/rules.lua: per_rule): "n1,n2,...,nr", commas
// so that a line member's entry can hold it before its promote time
// (lua/line.lua).
func (c Costs) arg() string {
	b := make([]byte, 0, 8*len(c))
	for i, n := range c {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(n), 10)
	}
	return string(b)
}

// most returns the largest of c, 0 for none, and whether every cost is
// that one (the single-n request).
func (c Costs) most() (int, bool) {
	m := 0
	for _, n := range c {
		m = max(m, n)
	}
	return m, !slices.ContainsFunc(c, func(n int) bool { return n != m })
}

// of returns the cost under rule i of a request of n permits with costs
// per (nil: n under every rule).
func (c Costs) of(i, n int) int {
	if c == nil {
		return n
	}
	return c[i]
}

// costs checks c against l's rules and returns the request it is: n, the
// largest cost, and per, the costs if they differ (nil if every rule is
// charged n, the single-n request). It needs one cost per rule, each from
// 0 to what its rule can admit at once, and with different costs a
// limiter whose every rule is over the caller's subject and none a
// Concurrency rule.
func (l *Limiter) costs(c Costs) (n int, per Costs, err error) {
	if len(c) != len(l.rules) {
		return 0, nil, fmt.Errorf("throttle: costs: %d given for %d rules; give one per rule, in the order of Limiter.Rules", len(c), len(l.rules))
	}
	for i, x := range c {
		if x < 0 {
			return 0, nil, fmt.Errorf("throttle: costs: rule %q: %d permits: must not be negative (0 leaves the rule out)", l.rules[i].Name, x)
		}
		if cp := l.rules[i].Limit.capacity(l.rules[i].Algorithm); x > cp {
			return 0, nil, capacityError(l.rules[i].Name, x, cp)
		}
	}
	n, same := c.most()
	if same {
		return n, nil, nil
	}
	if !l.oneSubject() || l.holders {
		return 0, nil, errors.New("throttle: costs: different costs per rule need every rule over the caller's subject (no Rule.Subject) and no Concurrency rule; use one limiter per subject")
	}
	return n, slices.Clone(c), nil // the caller may reuse c
}

// requestCosts is request (policy.go) for a request of n permits whose
// costs per rule are per (nil: n under every rule); each cost was checked
// (Limiter.costs).
func (p *policy) requestCosts(o op, subject string, n int, per Costs, bound int64, tickets []string) ([]string, []any, error) {
	if per == nil {
		return p.request(o, subject, n, bound, tickets)
	}
	// n = 0 passes request's check of one n against every rule; the costs
	// were checked rule by rule.
	keys, args, err := p.request(o, subject, 0, bound, tickets)
	if err != nil {
		return nil, nil, err
	}
	args[1] = per.arg()
	return keys, args, nil
}

// AllowCosts is AllowN with a cost per rule (see Costs): it takes each
// rule's cost if every rule has it now, and nothing otherwise, in one
// script call. Result's Remaining is the deciding rule's. Errors are
// AllowN's, and an error if c does not fit the limiter's rules (one cost
// per rule; different costs need every rule over the caller's subject
// and no Concurrency rule).
func (l *Limiter) AllowCosts(ctx context.Context, subject string, c Costs) (Result, error) {
	if err := l.open(); err != nil {
		return Result{}, err
	}
	n, per, err := l.costs(c)
	switch {
	case err != nil:
		return Result{}, err
	case per == nil:
		return l.mode.allow(ctx, subject, n)
	}
	res, _, err := l.decide(ctx, opAllow, subject, n, unbounded, false, per)
	return res, err
}

// ReserveCosts is ReserveN with a cost per rule (see Costs): it books the
// earliest slot at which every rule can grant its cost, in one round trip.
// The reservation's Cancel gives each rule back its own cost, and its
// Settle or SettleCosts corrects them. Errors are ReserveN's and
// AllowCosts's.
func (l *Limiter) ReserveCosts(ctx context.Context, subject string, c Costs) (*Reservation, error) {
	if err := l.open(); err != nil {
		return nil, err
	}
	n, per, err := l.costs(c)
	if err != nil {
		return nil, err
	}
	if per == nil {
		return l.mode.acquire(ctx, subject, n, true)
	}
	return l.reserveCosts(ctx, subject, n, per)
}

// WaitCosts is WaitN with a cost per rule (see Costs): it reserves the
// earliest slot at which every rule can grant its cost, in one round
// trip, and sleeps until it, cancelling the reservation if ctx ends first.
// Errors are WaitN's and AllowCosts's.
func (l *Limiter) WaitCosts(ctx context.Context, subject string, c Costs) error {
	if err := l.open(); err != nil {
		return err
	}
	n, per, err := l.costs(c)
	if err != nil {
		return err
	}
	if per == nil {
		return l.WaitN(ctx, subject, n)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	r, err := l.reserveCosts(ctx, subject, n, per)
	if err != nil {
		return err
	}
	return r.wait(ctx)
}

// SettleCosts is Settle with the real cost under each rule, in the order
// of Limiter.Rules (see Costs): each rule is given back, or charged, the
// difference from what the reservation took under it, in one script call.
// A rule the reservation did not charge (its cost was 0) is charged its
// actual cost if it is a TokenBucket or GCRA rule (into debt if need be);
// a window rule is left as it is. Errors are Settle's, and an error if
// actual does not have one cost per rule.
func (r *Reservation) SettleCosts(ctx context.Context, actual Costs) error {
	if len(actual) != len(r.lim.rules) {
		return fmt.Errorf("throttle: settle: %d costs given for %d rules; give one per rule, in the order of Limiter.Rules", len(actual), len(r.lim.rules))
	}
	for _, x := range actual {
		if x < 0 {
			return fmt.Errorf("throttle: settle: actual = %d permits: must not be negative", x)
		}
	}
	n, same := actual.most()
	if same {
		return r.Settle(ctx, n)
	}
	if len(r.parts) > 0 {
		return errors.New("throttle: settle: different costs per rule need every rule over the caller's subject; settle one cost with Settle")
	}
	return r.settleOnce(ctx, n, slices.Clone(actual))
}
