package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Reserve, then settle: for a budget whose real cost is known only after
// the work (the tokens an LLM call used), the caller reserves an estimate
// and, once it knows, settles the reservation to the actual cost in one
// script call on the Redis clock (lua/settle.lua): the
// difference is given back, or charged, into debt if need be.

// settledSuffix follows a rule's name: <rule>!settled records the
// permits given back by settles, which later settles take into account.
const settledSuffix = "!settled"

// ticketsSuffix names a subject's hash of the refund tickets of booked
// turns and receipts (<prefix>{<subject>}:!tickets), kept so that whoever
// redeems one (Admit) gets a Reservation it can settle.
const ticketsSuffix = "!tickets"

// opSettle is the operation (lua/settle.lua) that corrects a reservation.
const opSettle op = "settle"

// errSettled is Settle's error for a reservation already settled or
// cancelled.
var errSettled = errors.New("throttle: settle: the reservation was already settled or cancelled; settle it once")

// ticketsKey returns <prefix>{<subject>}:!tickets. The subject must have
// passed encodeSubject.
func (p *policy) ticketsKey(subject string) string {
	return key(p.prefix, escape(subject), ticketsSuffix)
}

// Settle corrects the reservation, once the caller has acted, to the
// permits it actually used: the difference from the permits reserved is
// given back (actual smaller) or charged (actual larger), under every rule,
// atomically, decided on the Redis clock. It is for costs known only
// afterwards: reserve an estimate, act, settle the real cost.
//
// Charged permits may exceed what a rule can admit at once: the rule is
// then in debt, and later requests wait until it is repaid. A charge lands
// where the reservation's permits were counted (the windows), or moves the
// bucket's next slot later.
//
// Given-back permits are bounded so that settling never lets a rule admit
// more than its bound (a window's count; a bucket's burst + rate in any
// span). A sliding window or sliding log gives back exactly, while the
// reservation's permits still count; a fixed window while the
// reservation's window is the current one. A token bucket or GCRA gives
// back exactly if no reservation was booked after this one; otherwise as
// much as the reservations booked behind it leave room for, about
// burst × interval less the time their estimates span (those booked at
// once: n × interval) less what other settles gave back meanwhile. So give
// a bucket whose costs are settled a burst well above the estimates in
// flight at once: then every unused permit comes back.
// (The windows settle exactly but book a backlog period by period,
// whatever comes back: for a budget settled under a backlog, prefer a
// bucket.)
//
// After a Reset of the subject, a reservation made before it gives
// nothing back: a Settle for less changes nothing. A Settle for more
// still charges the difference to the new state, into debt if need be:
// the work used those permits, whenever it ran, and a charge never lets a
// rule admit more than its bound.
//
// A reservation is settled once: a second Settle, or a Settle after
// Cancel, returns an error and changes nothing; Cancel after Settle does
// nothing. A reservation admitted without Redis (Options.FailOpen) settles
// to nothing. actual must not be negative, and a charge must not put a
// bucket rule more than ten years in debt. It returns an error matching
// ErrRedis if Redis fails (the reservation then keeps its permits).
func (r *Reservation) Settle(ctx context.Context, actual int) error {
	if actual < 0 {
		return fmt.Errorf("throttle: settle: actual = %d permits: must not be negative", actual)
	}
	return r.settleOnce(ctx, actual, nil)
}

// settleOnce is Settle to actual permits under every rule, or with
// actualPer, to those under each rule (actual their largest).
func (r *Reservation) settleOnce(ctx context.Context, actual int, actualPer Costs) error {
	if err := r.lim.checkDebt(r.n, r.per, actual, actualPer); err != nil {
		return err
	}
	done := false
	var err error
	r.once.Do(func() {
		done = true
		err = r.settle(ctx, actual, actualPer)
	})
	if !done {
		return errSettled
	}
	return err
}

// settle sends the correction of each part (a limiter over several
// subjects) or of the reservation itself.
func (r *Reservation) settle(ctx context.Context, actual int, actualPer Costs) error {
	var err error
	for _, p := range r.parts {
		err = errors.Join(err, p.Settle(ctx, actual))
	}
	if r.tickets == nil || r.unchanged(actual, actualPer) {
		return err
	}
	keys, args, rerr := settleArgs{subject: r.subject, n: r.n, actual: actual, per: r.per, actualPer: actualPer, tickets: r.tickets, booked: r.booked}.build(&r.lim.policy)
	if rerr != nil {
		return errors.Join(err, rerr)
	}
	_, rerr = r.lim.exec(ctx, opSettle, r.lim.scripts.settle, keys, args)
	return errors.Join(err, rerr)
}

// unchanged reports whether settling to actual (per rule: actualPer, if
// not nil) leaves every rule's charge as it is.
func (r *Reservation) unchanged(actual int, actualPer Costs) bool {
	for i := range r.lim.rules {
		if r.per.of(i, r.n) != actualPer.of(i, actual) {
			return false
		}
	}
	return true
}

// checkDebt refuses a settle of n permits (per rule: per, if not nil) to
// actual (per rule: actualPer) that would put a bucket rule more than
// maxPeriod in debt, beyond exact arithmetic in Lua.
func (l *Limiter) checkDebt(n int, per Costs, actual int, actualPer Costs) error {
	for i, r := range l.rules {
		m, a := per.of(i, n), actualPer.of(i, actual)
		if a <= m || !r.Algorithm.bucket() {
			continue
		}
		if d := float64(a-m) * float64(r.Limit.Period) / float64(r.Limit.Count); d > float64(maxPeriod) {
			return fmt.Errorf("throttle: settle: actual = %d permits: rule %q would be %v in debt; at most %v", a, r.Name, time.Duration(d).Round(time.Hour), maxPeriod)
		}
	}
	return nil
}
