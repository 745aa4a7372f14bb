package throttle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
	// N is the number of permits (at least 1; an error matching
	// ErrExceedsCapacity if more than a rule can ever admit). With a
	// Concurrency rule, N = 0 takes nothing and only brings the places up
	// to date: the places of expired leases are handed to their waiters
	// (Options.OnHandoff); the answer is Booked, At the earliest lease's
	// expiry, while some wait (look again then: that is how a fleet whose
	// holders all died goes on), else Denied.
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
	// Horizon bounds how far ahead a new booking may be. A caller with an
	// ID whose turn would be later, or who comes while others wait in the
	// subject's line, joins that line instead (Admission.InLine) and is
	// charged nothing: turns are booked for the line's members, in order,
	// only as they come within the horizon, by Admit with N = 0. So the
	// bookings of a long backlog never reach further ahead than the
	// horizon, and a rule whose limit changes (a new Limiter over the same
	// rule names) is in force within a horizon, whatever the backlog. A
	// caller without an ID is Denied past the horizon. If zero, there is
	// no bound and no line. A limiter with a Concurrency rule ignores it:
	// its queue for places is its line.
	Horizon time.Duration
	// Share, with a Horizon, is the caller's share of the subject's line
	// (a tenant of one API key): the shares with callers in line are
	// served in turn, each in proportion to its Weight, so a share with
	// ten callers waiting is not served after one with ten thousand that
	// came first. Callers of one share are served in order. Empty is a
	// share like any other.
	Share string
	// Weight is the Share's weight in the line, from 1 (the default, if
	// zero) to 1000.
	Weight int
	// ShareLimit, if set (not the zero Limit), is a limit on each Share of
	// the line of its own, a leaky bucket (GCRA) kept under the subject's
	// hash tag: a per-tenant limit inside one API key's. A caller is
	// admitted only when both the limiter's rules and its share's limit
	// admit it, in one script. A share its own limit holds back waits in
	// the line, charged nothing, while the other shares are served; when
	// no other share waits, its turn is booked ahead for the moment its
	// limit admits it (within the Horizon), so the rules' turns before it
	// go unused only if nobody wanted them when it was booked. Every caller
	// and every serving of one subject's line should pass the same
	// ShareLimit; it needs a Horizon, an ID, rules of the bucket
	// algorithms (GCRA, TokenBucket), and N at most its Burst (zero Burst
	// is Count).
	ShareLimit Limit
	// Waiter identifies the caller under the limiter's Concurrency rule,
	// as the holder of a place or in the queue for one, across its
	// arrivals: Options.OnHandoff receives it when a freed place is handed
	// to the caller while it is parked. If empty, ID; one of them is
	// required with a Concurrency rule.
	Waiter string
	// WaitAs, if not empty, is the Waiter the caller comes back as, if not
	// Waiter (a task requeued as a copy): it takes over Waiter's place in
	// the queue, or the place it holds.
	WaitAs string
	// Tolerance is how late a caller may come back for its booking or
	// receipt: one that comes later takes a new turn, and its old slot
	// (long past) is not redeemed, so a fleet that was down does not run
	// its overdue work in one burst. (A booking whose slot falls inside a
	// pause, PauseFor, is not redeemed either.) If zero, the interval of
	// the limiter's tightest rate rule (Period / Count), at least 1ms and
	// at most 1s; negative is an error.
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
	// for Admission.At. Leave, and come back then. With a Concurrency
	// rule (Admission.Rule names it) whose places are all taken: the
	// caller is in the queue for one; leave, and come back when
	// Options.OnHandoff names it, or at Admission.At at the latest.
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
	// caller will not act, or to Settle once it has. A Redeemed turn's
	// is there to Settle (its Cancel gives nothing back: the turn is
	// spent); nil otherwise.
	Reservation *Reservation
	// Lease is the lease of the limiter's Concurrency rule when the answer
	// is about a place under it: Granted or Redeemed (the caller holds a
	// place until Release) or Booked by that rule (the caller is queued
	// for a place, and Rule names the rule). Zero otherwise, and always
	// for a limiter without a Concurrency rule.
	Lease time.Duration
	// InLine is true when the caller, Booked, waits in the subject's line
	// (AdmitRequest.Horizon) instead of holding a turn: leave, and come
	// back when a turn is booked for it (Handed names it to whoever
	// serves the line), or at At at the latest; coming back still in line
	// keeps its place.
	InLine bool
	// Serve, if not zero, is when the line should next be served (Admit
	// with N = 0), on the Redis clock: set for the caller that starts the
	// line, and for one that comes back still in it when nobody has served
	// the line for two horizons (serve at once: whoever served it may have
	// stopped). Other callers in line leave it zero.
	Serve time.Time
	// Handed is, for Admit with N = 0 and a Horizon (serving the line),
	// the members of the line just booked: each one's Waiter (or WaitAs,
	// BookAs, ID, the first set) with its slot on the Redis clock. Status
	// is Booked while callers remain in line, with Serve when to serve it
	// next; Denied once the line is empty.
	Handed map[string]time.Time
}

// Reply statuses of the driver's admit operation (lua/driver.lua).
const (
	admitDenied   = 0
	admitGranted  = 1
	admitBooked   = 2
	admitRedeemed = 3
	admitHeld     = 4
	admitQueued   = 5 // waiting for a place of the Concurrency rule
	admitInLine   = 6 // waiting in the subject's line (AdmitRequest.Horizon)
)

// maxWeight bounds AdmitRequest.Weight.
const maxWeight = 1000

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
	if len(req.ID) > maxReceiptLen || len(req.Receipt) > maxReceiptLen || len(req.BookAs) > maxReceiptLen || len(req.Waiter) > maxReceiptLen || len(req.WaitAs) > maxReceiptLen || len(req.Share) > maxReceiptLen {
		return Admission{}, fmt.Errorf("throttle: admit: an ID, receipt, waiter or share is at most %d bytes; hash longer ones", maxReceiptLen)
	}
	if req.Weight < 0 || req.Weight > maxWeight {
		return Admission{}, fmt.Errorf("throttle: admit: weight %d: must be between 1 and %d (0 is 1)", req.Weight, maxWeight)
	}
	serving := req.N == 0 && l.leases == nil
	if serving && req.Horizon <= 0 {
		return Admission{}, errors.New("throttle: admit: n = 0 serves the subject's line, which needs a Horizon")
	}
	if req.Horizon < 0 || req.Horizon > maxPeriod {
		return Admission{}, fmt.Errorf("throttle: admit: horizon %v: must be between 0 (no bound) and %v", req.Horizon, maxPeriod)
	}
	wait, horizon := micros(req.Wait), unbounded
	if req.Horizon > 0 && l.leases == nil {
		horizon = req.Horizon.Microseconds()
	}
	capped := req.ShareLimit != Limit{}
	if capped {
		if err := l.checkShareLimit(&req, horizon); err != nil {
			return Admission{}, err
		}
	}
	keys, args, err := l.request(opAdmit, req.Subject, req.N, wait, nil)
	if err != nil {
		return Admission{}, err
	}
	keys = append(keys, l.receiptsKey(req.Subject), l.pauseKey(req.Subject), l.ticketsKey(req.Subject))
	keys = append(keys, l.lineKeys(req.Subject)...)
	keys = append(keys, l.upstreamKey(req.Subject)) // lua/upstream_pace.lua
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
	// The caller under the Concurrency rule, if any, or in the line.
	waiter, waitAs := "", cmp.Or(req.WaitAs, req.Waiter, req.BookAs, req.ID)
	if l.leases != nil {
		if waiter = cmp.Or(req.Waiter, req.ID); waiter == "" {
			return Admission{}, errors.New("throttle: admit: a limiter with a concurrency rule needs an ID or a Waiter")
		}
		waitAs = cmp.Or(req.WaitAs, waiter)
	}
	args = append(args, booking, max(req.Tolerance.Microseconds(), 1), horizon, early, waiter, waitAs, req.Share, max(req.Weight, 1))
	if capped && horizon != unbounded {
		args = append(args, req.ShareLimit.Count, req.ShareLimit.Period.Microseconds(), req.ShareLimit.Burst)
	} else {
		args = append(args, 0, 0, 0)
	}
	for _, id := range [...]string{req.ID, req.Receipt} {
		if id != "" {
			args = append(args, l.member(id))
		}
	}
	rep, recv, err := l.call(ctx, opAdmit, keys, args)
	woken := l.leases.woken(rep.raw, len(l.rules))
	if re, ok := err.(*redisError); ok && serving {
		return Admission{}, re
	} else if ok {
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
		a.Reservation = &Reservation{lim: l, subject: req.Subject, n: req.N, tickets: rep.tickets(len(l.rules)), delay: a.Delay, at: a.At, booked: rep.redisNow}
	case admitBooked:
		a.Status, a.Rule = Booked, res.Rule
	case admitRedeemed:
		a.Status = Redeemed
		if t, booked := redeemedTickets(rep.raw, len(l.rules)); t != nil {
			// To settle (Reservation.Settle); the turn is spent, so
			// Cancel gives nothing back.
			a.Reservation = &Reservation{lim: l, subject: req.Subject, n: req.N, tickets: t, delay: a.Delay, at: a.At, spent: true, booked: booked}
		}
	case admitHeld:
		a.Status = Held
	case admitQueued:
		a.Status, a.Rule = Booked, res.Rule
	case admitInLine:
		a.Status, a.Rule, a.InLine = Booked, res.Rule, true
		if serve, _ := rep.raw[4].(int64); serve >= 0 {
			a.Serve = time.UnixMicro(rep.redisNow + serve)
		}
	default:
		return Admission{}, badReply(rep.raw)
	}
	if serving {
		a.Handed = handed(rep.raw, len(l.rules))
		if a.Status == Booked {
			a.Serve, a.Rule = a.Slot, ""
		}
	}
	if l.leases != nil {
		if req.N > 0 && (a.Status == Granted || a.Status == Redeemed) {
			l.leases.hold(req.Subject, waitAs)
			a.Lease = l.leases.lease
		}
		if rep.status == admitQueued {
			a.Lease = l.leases.lease
		}
		l.leases.deliver(woken)
	}
	return a, nil
}

// handed reads the members a serving of the line booked: the waiter and
// slot pairs after the reply's 6 + nrules values.
func handed(raw []any, nrules int) map[string]time.Time {
	if len(raw) <= 6+nrules {
		return nil
	}
	h := make(map[string]time.Time, (len(raw)-6-nrules)/2)
	for i := 6 + nrules; i+1 < len(raw); i += 2 {
		w, _ := raw[i].(string)
		us, err := strconv.ParseInt(fmt.Sprint(raw[i+1]), 10, 64)
		if err == nil {
			h[w] = time.UnixMicro(us)
		}
	}
	return h
}

// lineKeys returns the keys of subject's line (AdmitRequest.Horizon)
// under this limiter's rules: <prefix>{<subject>}:!line(<rule>,...), its
// :e and :f hashes, and the sorted sets of its shares' limits, :h, :q, :s
// and :c (driver.lua). The rules are in the name because a serving books
// its members' turns under the serving limiter's rules: two limiters over
// one subject (two rules drawing on one budget, each with a limit of its
// own) have a line each, and neither books the other's members.
func (p *policy) lineKeys(subject string) []string {
	k := key(p.prefix, escape(subject), lineSuffix+"("+strings.Join(p.keyRules, ",")+")")
	return []string{k, k + ":e", k + ":f", k + ":h", k + ":q", k + ":s", k + ":c"}
}

// checkShareLimit checks req.ShareLimit (not the zero Limit), giving a zero Burst the
// Count. Every rule must be a bucket: a turn of a share its own limit
// holds back is booked ahead for when that limit admits it (driver.lua,
// take), which a bucket's state, a time, can record for any moment.
func (l *Limiter) checkShareLimit(req *AdmitRequest, horizon int64) error {
	for _, r := range l.rules {
		if !r.Algorithm.bucket() {
			return fmt.Errorf("throttle: admit: a share limit needs rules of the bucket algorithms (gcra, token_bucket), which can book a turn for any moment; rule %q is %s", r.Name, r.Algorithm)
		}
	}
	sl := &req.ShareLimit
	if sl.Burst == 0 {
		sl.Burst = sl.Count
	}
	if err := (Rule{Name: "share limit", Algorithm: GCRA, Limit: *sl}).Validate(); err != nil {
		return fmt.Errorf("throttle: admit: %w", err)
	}
	if horizon == unbounded {
		return errors.New("throttle: admit: a share limit needs a Horizon (and no concurrency rule): the shares' limits are kept in the subject's line")
	}
	if req.N > 0 && req.ID == "" && req.BookAs == "" {
		return errors.New("throttle: admit: a share limit needs an ID: a caller its share's limit holds back waits in the subject's line, under its ID")
	}
	if req.N > sl.Burst {
		return fmt.Errorf("%w: %d permits, but the share limit (%s) admits at most %d at once", ErrExceedsCapacity, req.N, sl.describe(), sl.Burst)
	}
	return nil
}

// lineSuffix names a subject's line.
const lineSuffix = "!line"
