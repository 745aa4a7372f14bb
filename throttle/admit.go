package throttle

import (
	"context"
	"fmt"
	"time"
)

// Admit is the decision for a caller that can leave and come back: a queued
// job. In one round trip it redeems the caller's booking (made by an
// earlier Admit under the same ID) or a receipt from PrepayN, or takes a
// new turn: granted if the slot is within Wait, booked under ID for later
// otherwise. Every algorithm can book, the windows included: their state
// holds future admissions (each algorithm's Lua file says how).

// AdmitRequest is what Admit decides on.
type AdmitRequest struct {
	// Subject is what is limited, as for Allow. Required.
	Subject string
	// N is the number of permits (at least 1; an error matching ErrExceedsCapacity if more
	// than a rule can ever admit).
	N int
	// ID identifies the caller across arrivals (a task ID): a slot too
	// late for Wait is booked under it, and redeemed when the caller
	// comes back with the same ID. If empty, nothing is booked: a slot
	// later than Wait is Denied.
	ID string
	// Receipt, if not empty, is a receipt from PrepayN that the caller
	// carries; it is redeemed like a booking.
	Receipt string
	// BookAs, if not empty, is the ID a new turn is booked under instead
	// of ID: for a caller that will come back under another identity (a
	// task requeued as a copy). ID is still redeemed.
	BookAs string
	// Wait is how long the caller can wait where it is for a new turn. A
	// negative Wait means without bound (nothing is booked).
	Wait time.Duration
	// EarlyWait is how long the caller can wait where it is for its booking
	// or receipt, if it comes back before the turn; a later one is Held.
	// If zero, Wait. A caller may wait longer for a turn it already has
	// than for a new one: it leaves no one else waiting.
	EarlyWait time.Duration
	// Horizon bounds how far ahead a new booking may be: a later slot is
	// Denied and charges nothing. If zero, there is no bound.
	Horizon time.Duration
	// Tolerance is how late a caller may come back for its booking or
	// receipt: one that comes later takes a new turn, and its old slot
	// (long past) is not redeemed, so a fleet that was down does not run
	// its overdue work in one burst. (A booking whose slot falls inside a
	// pause, PauseFor, is not redeemed either.) If zero, the interval of
	// the limiter's tightest rule (Period / Count), at least 1ms and at
	// most 1s; negative is an error.
	Tolerance time.Duration
}

// AdmitStatus is what an Admit caller does next; its value is its name.
type AdmitStatus string

const (
	// Denied: the slot would be past the Horizon (or past Wait with no ID);
	// nothing was charged. Admission.Delay says when it would be.
	Denied AdmitStatus = "denied"
	// Granted: a new turn within Wait. Act at Admission.At; if the caller
	// will not act, Admission.Reservation.Cancel refunds it.
	Granted AdmitStatus = "granted"
	// Booked: a new turn later than Wait, booked under the request's ID
	// for Admission.At. Leave, and come back then.
	Booked AdmitStatus = "booked"
	// Redeemed: the caller's booking or receipt is due within Wait, and is
	// used up. Act at Admission.At.
	Redeemed AdmitStatus = "redeemed"
	// Held: the caller's booking or receipt is for Admission.At, later
	// than Wait. It is kept: leave, and come back then.
	Held AdmitStatus = "held"
)

// Admission is Admit's answer.
type Admission struct {
	Status AdmitStatus
	// Rule is the rule that decided (for a new turn: the one with the
	// longest delay); empty for a redeemed or held booking.
	Rule string
	// Delay is how long from the decision until the slot.
	Delay time.Duration
	// At is the slot on the local monotonic clock: when to act (Granted,
	// Redeemed) or to come back (Booked, Held).
	At time.Time
	// Slot is the slot on the Redis clock, which orders the slots of
	// every process: use it to schedule a wake-up in Redis.
	Slot time.Time
	// Reservation holds a Granted turn's permits, to Cancel if the
	// caller will not act; nil otherwise.
	Reservation *Reservation
}

// Reply statuses of the driver's admit operation (lua/driver.lua).
const (
	admitDenied   = 0
	admitGranted  = 1
	admitBooked   = 2
	admitRedeemed = 3
	admitHeld     = 4
)

// Admit decides for a caller that can come back later; see AdmitRequest
// and AdmitStatus. It returns an error matching ErrExceedsCapacity if N is more than a rule
// can ever admit, an error matching ErrInvalidSubject for a bad subject,
// and an error matching ErrRedis if Redis fails (a FailOpen limiter
// grants instead).
func (l *Limiter) Admit(ctx context.Context, req AdmitRequest) (Admission, error) {
	if req.Tolerance < 0 {
		return Admission{}, fmt.Errorf("throttle: admit: tolerance %v: must not be negative", req.Tolerance)
	}
	if req.Tolerance == 0 {
		req.Tolerance = l.tolerance
	}
	if l.parts != nil {
		return l.admitParts(ctx, req)
	}
	if len(req.ID) > maxReceiptLen || len(req.Receipt) > maxReceiptLen || len(req.BookAs) > maxReceiptLen {
		return Admission{}, fmt.Errorf("throttle: admit: an ID or receipt is at most %d bytes; hash longer ones", maxReceiptLen)
	}
	if req.Horizon < 0 || req.Horizon > maxPeriod {
		return Admission{}, fmt.Errorf("throttle: admit: horizon %v: must be between 0 (no bound) and %v", req.Horizon, maxPeriod)
	}
	wait, horizon := micros(req.Wait), unbounded
	if req.Horizon > 0 {
		horizon = req.Horizon.Microseconds()
	}
	keys, args, err := l.request(opAdmit, req.Subject, req.N, wait, nil)
	if err != nil {
		return Admission{}, err
	}
	keys = append(keys, l.receiptsKey(req.Subject), l.pauseKey(req.Subject))
	booking := ""
	switch {
	case req.BookAs != "":
		booking = l.member(req.BookAs)
	case req.ID != "":
		booking = l.member(req.ID)
	}
	early := wait
	if req.EarlyWait > 0 {
		early = req.EarlyWait.Microseconds()
	}
	args = append(args, booking, max(req.Tolerance.Microseconds(), 1), horizon, early)
	for _, id := range [...]string{req.ID, req.Receipt} {
		if id != "" {
			args = append(args, l.member(id))
		}
	}
	rep, recv, err := l.call(ctx, opAdmit, keys, args)
	if re, ok := err.(*redisError); ok {
		r, err := l.failOpenOr(ctx, opAdmit, req.Subject, req.N, re.err)
		if err != nil {
			return Admission{}, err
		}
		return Admission{Status: Granted, Rule: l.rules[0].Name, At: r.at, Reservation: r}, nil
	}
	if err != nil {
		return Admission{}, err
	}
	res := rep.Result
	a := Admission{
		Delay: res.RetryAfter,
		Slot:  time.UnixMicro(rep.redisNow).Add(res.RetryAfter),
	}
	a.At = l.clock.wake(recv, rep.redisNow, a.Delay)
	switch rep.status {
	case admitDenied:
		a.Status, a.Rule = Denied, res.Rule
	case admitGranted:
		a.Status, a.Rule = Granted, res.Rule
		a.Reservation = &Reservation{lim: l, subject: req.Subject, n: req.N, tickets: rep.tickets(len(l.rules)), delay: a.Delay, at: a.At}
	case admitBooked:
		a.Status, a.Rule = Booked, res.Rule
	case admitRedeemed:
		a.Status = Redeemed
	case admitHeld:
		a.Status = Held
	default:
		return Admission{}, badReply(rep.raw)
	}
	return a, nil
}
