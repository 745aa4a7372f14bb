package throttle

import (
	"context"
	"errors"
	"sync"
	"time"
)

// refundTimeout bounds the refund a cancelled Wait sends after its own
// context has ended.
const refundTimeout = 2 * time.Second

// Detach returns a context for giving back, on a caller's behalf, what it
// holds once its own ctx has ended or is about to (Reservation.Cancel,
// Settle or Rebook, Place.Release): ctx's values without its cancellation
// or deadline, bounded as the limiter bounds its own refunds (2s). A call
// that fails because that bound passed is reported to
// Options.OnRedisError, as the limiter's own refunds are; under a bound of
// the caller's own (context.WithTimeout) it would not be, since a call its
// caller's deadline ends is no Redis failure. Call cancel when done.
func (l *Limiter) Detach(ctx context.Context) (context.Context, context.CancelFunc) {
	return ownTimeout(context.WithoutCancel(ctx), refundTimeout)
}

// A Reservation holds permits granted by Reserve (or acquired by Wait)
// until the caller acts or cancels.
type Reservation struct {
	lim     *Limiter
	subject string
	n       int
	per     Costs         // the permits under each rule if they differ (ReserveCosts, AdmitRequest.Costs), else nil: n under every rule
	tickets []string      // one refund ticket per rule; nil if admitted without Redis (fail open)
	share   string        // a turn under AdmitRequest.ShareLimit: its share ticket (lua/refund.lua), else ""
	receipt string        // the receipt id of a prepaid reservation (prepay.go), else ""
	delay   time.Duration // the delay Redis granted, from its now (prepay.go)
	at      time.Time     // local monotonic time to act (redisClock.wake)

	slot time.Time // a prepaid reservation's or an Admit turn's slot on the Redis clock (prepay.go, rebook.go)

	booked int64 // Redis time (µs) of the call that made it, for refunds and Settle; -1 if unknown

	rebookAs string // an Admit turn: the member Rebook books it again under, "" if none
	tol      int64  // and its request's Tolerance (µs)

	parts []*Reservation // a limiter over several subjects: each part's (subjects.go)

	once      sync.Once
	spent     bool // a redeemed booking or receipt (admit.go): Cancel gives nothing back, Settle corrects it; beside once, whose 12 bytes leave room for it
	cancelErr error
}

// Delay is how long the caller must still wait before acting, 0 once the
// time to act has passed: the slot Redis granted, mapped from Redis's
// clock onto the local monotonic clock, so that it does not
// move with the latency of the reply. As in golang.org/x/time/rate, it
// shrinks as time passes; read it right after ReserveN for the delay
// Redis granted, and act at time.Now().Add(Delay()).
func (r *Reservation) Delay() time.Duration { return max(0, time.Until(r.at)) }

// Cancel tells the limiter that the caller will not act, and gives back
// what it can, as golang.org/x/time/rate's Cancel does, decided on the
// Redis clock: after the time to act, nothing (the permits are taken to
// be used); before it, the permits less those that later reservations
// already took. Later reservations keep their slots; permits they hold
// come back when those are cancelled too (Redis remembers, whichever
// process cancels, in whatever order; x/time/rate would keep them). A
// prepaid reservation (PrepayN) also loses its receipt. A turn Admit
// granted under a ShareLimit gives its share's turn back too, by the same
// rules. A reservation made
// before a Reset of its subject gives nothing back (see Reset). Calling it
// again does nothing and returns the first call's error.
func (r *Reservation) Cancel(ctx context.Context) error {
	return r.cancel(ctx, false)
}

// cancel is Cancel; with undo (rolling back one subject's part, which its caller
// never used) the permits come back even after the time to act.
func (r *Reservation) cancel(ctx context.Context, undo bool) error {
	r.once.Do(func() {
		for _, p := range r.parts {
			r.cancelErr = errors.Join(r.cancelErr, p.cancel(ctx, undo))
		}
		gone := false
		if r.receipt != "" {
			// First, so that the receipt can no longer be redeemed. One
			// no longer there lapsed (and gave back what a lapse gives:
			// a calendar quota's unit, rules.lua) or was redeemed: it
			// gives nothing back a second time.
			gone, r.cancelErr = r.lim.dropReceipt(ctx, r.subject, r.receipt)
		}
		if r.tickets != nil && !r.spent && !gone {
			r.cancelErr = errors.Join(r.cancelErr, r.lim.refund(ctx, r.subject, refundEntry{n: r.n, per: r.per, booked: r.booked, tickets: r.tickets, share: r.share}, undo))
		}
	})
	return r.cancelErr
}

// wait sleeps until the reservation's time to act. If ctx ends first, it
// cancels the reservation and returns ctx.Err().
func (r *Reservation) wait(ctx context.Context) error {
	if err := sleep(ctx, time.Until(r.at)); err != nil {
		r.cancelDetached(ctx, false)
		return err
	}
	return nil
}

// cancelDetached refunds after ctx has ended, on a context that keeps
// ctx's values but not its cancellation; undo as for cancel.
func (r *Reservation) cancelDetached(ctx context.Context, undo bool) {
	rctx, cancel := ownTimeout(context.WithoutCancel(ctx), refundTimeout)
	defer cancel()
	_ = r.cancel(rctx, undo)
}
