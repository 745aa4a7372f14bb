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

// A Reservation holds permits granted by Reserve (or acquired by Wait)
// until the caller acts or cancels.
type Reservation struct {
	lim     *Limiter
	subject string
	n       int
	tickets []string // one refund ticket per rule; nil if admitted without Redis (fail open)
	receipt string   // the receipt id of a prepaid reservation (prepay.go), else ""
	delay   time.Duration
	at      time.Time // local monotonic time to act (redisClock.wake)

	slot time.Time // a prepaid reservation's slot on the Redis clock (prepay.go)

	once      sync.Once
	cancelErr error
}

// Delay is how long the caller had to wait, from the moment Redis
// granted the reservation, before acting.
func (r *Reservation) Delay() time.Duration { return r.delay }

// TimeToAct is the local time at which the caller may act: the slot Redis
// granted, mapped from Redis's clock onto the local monotonic clock
// (clock.go), so that it does not move with the latency of the reply.
func (r *Reservation) TimeToAct() time.Time { return r.at }

// Cancel gives the reserved permits back. Later reservations granted on
// the strength of them keep their slots, so those permits come back only
// when the later ones are cancelled too (Redis remembers, whichever
// process cancels, in whatever order), or at once as far as the later ones
// hold fewer permits (as x/time/rate's Cancel does). Use it when the
// caller will not act. A prepaid reservation (PrepayN) also loses its
// receipt. Calling it again does nothing and returns the first call's
// error.
func (r *Reservation) Cancel(ctx context.Context) error {
	r.once.Do(func() {
		if r.receipt != "" {
			// First, so that the receipt can no longer be redeemed.
			r.cancelErr = r.lim.dropReceipt(ctx, r.subject, r.receipt)
		}
		if r.tickets != nil {
			r.cancelErr = errors.Join(r.cancelErr, r.lim.refund(ctx, r.subject, r.n, r.tickets))
		}
	})
	return r.cancelErr
}

// wait sleeps until the reservation's time to act. If ctx ends first, it
// cancels the reservation and returns ctx.Err().
func (r *Reservation) wait(ctx context.Context) error {
	if err := sleep(ctx, time.Until(r.at)); err != nil {
		r.cancelDetached(ctx)
		return err
	}
	return nil
}

// cancelDetached refunds after ctx has ended, on a context that keeps
// ctx's values but not its cancellation.
func (r *Reservation) cancelDetached(ctx context.Context) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refundTimeout)
	defer cancel()
	_ = r.Cancel(rctx)
}
