package throttle

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Admit is the decision for a caller that can leave and come back: a queued
// job. In one round trip it redeems the caller's booking (made by an
// earlier Admit under the same ID) or a receipt from PrepayN, or takes a
// new turn: granted if the slot is within Wait, booked under ID for later
// otherwise. Every algorithm can book, the windows included: their state
// holds future admissions (each algorithm's Lua file says how).

// Caller is an Admit caller's identities across its arrivals (a queued
// task's): who books a turn and redeems it (ID, Receipt, BookAs), who
// holds or waits for a place of a Concurrency rule (Waiter, WaitAs), and
// which share of the subject's line it is in (Share, Weight). Each empty
// field has its default from the others, applied in one place: the zero
// Caller books nothing, holds no place and is the empty share.
type Caller struct {
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
	// Waiter identifies the caller under the limiter's Concurrency rule,
	// as the holder of a place or in the queue for one, across its
	// arrivals: Options.OnHandoff receives it when a freed place is handed
	// to the caller while it is parked. If empty, ID; one of them is
	// required with a Concurrency rule.
	Waiter string
	// WaitAs, if not empty, is the Waiter the caller comes back as, if not
	// Waiter (a task requeued as a copy): it takes over Waiter's position in
	// the queue, or the place it holds.
	WaitAs string
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
	// Priority, with a Horizon, is the caller's level in the subject's
	// line, from 0 (the default) to 9: the line serves its
	// higher levels first, and the shares within a level by Weight. A
	// caller in line longer than AdmitRequest.MaxAge is served before
	// every caller that joined after it, whatever their levels, so no
	// level waits forever. It orders the line only: a turn already booked
	// is kept (a higher caller that comes later takes the turns after it),
	// and a caller that finds nobody in line takes its turn as any other.
	// Not with AdmitRequest.ShareLimit.
	Priority int
}

// maxPriority is the highest Caller.Priority: the line has ten levels, 0
// to 9, and serves 9 first (admission.MaxPriority).
const maxPriority = 9

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
	// Costs, if not nil, is what the caller takes under each rule, in the
	// order of Limiter.Rules, in place of N (which must then be 0): one
	// LLM call's requests, input tokens and output tokens, decided in one
	// call (see Costs). A rule whose cost is 0 does not delay the turn.
	// A caller in the line keeps its costs: its turn is booked at them.
	// At least one cost must be above 0; different costs need every rule
	// over the caller's subject, no Concurrency rule and no ShareLimit.
	// The Reservation of a Granted or Redeemed turn settles them
	// (Reservation.SettleCosts).
	Costs Costs
	// Caller names the caller across its arrivals: under which ID its
	// turns are booked and redeemed, under which name it holds or waits
	// for a place of a Concurrency rule, and its share of the line.
	Caller
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
	// only as they come within the horizon, by ServeLine. So the
	// bookings of a long backlog never reach further ahead than the
	// horizon, and a rule whose limit changes (a new Limiter over the same
	// rule names) is in force within a horizon, whatever the backlog. A
	// caller without an ID is Denied past the horizon. If zero, there is
	// no bound and no line. A limiter with a Concurrency rule ignores it:
	// its queue for places is its line.
	Horizon time.Duration
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
	// MaxAge bounds how long a caller waits in the subject's line while
	// callers of a higher Priority that joined after it are served: once
	// it has waited MaxAge (on the Redis clock, from when it joined), it is
	// served before every caller that joined after it, whatever their
	// levels, the earliest promoted first. So a line whose higher levels
	// never empty still serves a lower caller about MaxAge after it
	// joined, plus the time to serve those promoted before it. Give every
	// caller of one line the same MaxAge. If zero: for a Priority above 0,
	// 60 horizons (a minute at a horizon of one second); for Priority 0,
	// the caller is never promoted
	// (a line without priorities, as before they existed). At most
	// the longest period (ten years). Ignored without a Horizon.
	MaxAge time.Duration
	// Tolerance is how late a caller may come back for its booking or
	// receipt: one that comes later takes a new turn, and its old slot
	// (long past) is not redeemed, so a fleet that was down does not run
	// its overdue work in one burst; a GCRA or TokenBucket rule gets the
	// unused turn back, as a settle to nothing gives it back (so a task
	// late on asynq's schedule costs the rule one turn, not two). (A booking whose slot falls inside a
	// pause, PauseFor, is not redeemed either.) If zero, the length of the
	// caller's turn under the tightest rate rule it charges (its cost ×
	// Period / Count: the interval for N = 1; 150ms for 600 tokens of a
	// 4,000-a-second rule), at least 1ms and at most 1s: a turn that
	// starts late by its own length keeps any window within the rule's
	// limit + burst + one turn. Negative is an error.
	Tolerance time.Duration
	// NotBefore, if not zero, is the earliest a new turn may take, on the
	// Redis clock (an Admission's Slot): the turn is at NotBefore or
	// later, and the rules' capacity before it stays unused by this
	// caller. So one caller can hold turns of several limiters that meet
	// at one time (admission.Stack: a per-key limit inside a per-tenant
	// one over several keys). A redeemed booking or receipt is not moved.
	// It needs rules of the bucket algorithms (GCRA, TokenBucket), no
	// Horizon and no ShareLimit. A bucket cannot hold a gap: a turn booked
	// after its latest one leaves the time between them unused by anyone.
	NotBefore time.Time
	// HeadServes, with a Horizon, has the members of the subject's line
	// serve it, for a caller whose queue wakes each member itself
	// (admission.Parking): the line's next serving is its head's return
	// (Admission.Head, at Admission.Serve), not a ServeLine. A caller that
	// starts the line is its head, told to come back at its own turn; a
	// caller that comes back still in line serves it in its own call, as
	// ServeLine does, whatever its Status: its own turn, if within the
	// horizon, is booked and then redeemed (or Held) at once, and the
	// Admission says what the serving did (Handed, Waiting, and the next
	// Head and Serve). The last member a serving booked serves the line
	// again when it comes back for its turn, in the same call: turns its
	// predecessors' settles gave back (Reservation.Settle) are booked
	// then, where the head, woken at the turn it was named for, would
	// find them passed. So a member of a line costs two calls (the Admit
	// that joins, the one that takes its turn) and one wake-up, where a
	// serving costs a call and wake-ups of its own. A line whose head
	// never comes back is served when another member comes back by
	// itself (at its Admission.At). Ignored with a ShareLimit or a
	// Concurrency rule.
	HeadServes bool
}

// Admission is Admit's answer.
type Admission struct {
	// Status says what became of the caller's turn, and so what it does
	// next (see AdmitStatus).
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
	// caller will not act, to Settle once it has, or to Rebook for its
	// return if it leaves before the slot. A Redeemed turn's
	// is there to Settle (its Cancel gives nothing back: the turn is
	// spent), or to Rebook if the caller leaves before its slot; nil
	// otherwise.
	Reservation *Reservation
	// Place is the place of the limiter's Concurrency rule that a Granted
	// or Redeemed caller now holds: give it back with Place.Release when
	// the work ends. Nil otherwise, and always for a limiter without a
	// Concurrency rule.
	Place *Place
	// Lease is the lease of the limiter's Concurrency rule when the answer
	// is about a place under it: Granted or Redeemed (the caller holds
	// Place until it releases it) or Booked by that rule (the caller is queued
	// for a place, and Rule names the rule). Zero otherwise, and always
	// for a limiter without a Concurrency rule.
	Lease time.Duration
	// InLine is true when the caller, Booked, waits in the subject's line
	// (AdmitRequest.Horizon) instead of holding a turn: leave, and come
	// back when a turn is booked for it (Handed names it to whoever
	// serves the line), or at At at the latest; coming back still in line
	// keeps its position.
	InLine bool
	// Serve, if not zero, is when the line should next be served (Admit
	// ServeLine), on the Redis clock: set for the caller that starts the
	// line, and for one that comes back still in it when nobody has served
	// the line for two horizons (serve at once: whoever served it may have
	// stopped). Other callers in line leave it zero. With Head, it is when
	// Head's turn comes: wake it then, and its return serves the line.
	Serve time.Time
	// Head, with AdmitRequest.HeadServes, is the member of the line whose
	// return serves it next (its name, as Handed's), woken at Serve: the
	// caller, if it started the line, or the next head after the caller's
	// serving. Empty otherwise, and then a Serve is for ServeLine.
	Head string
	// Handed is, for Admit with N = 0 and a Horizon (serving the line, as
	// ServeLine does), the members of the line just booked: each one's
	// name (Caller.WaitAs, or Waiter, BookAs, ID: the first set) with its
	// slot on the Redis clock. Status is Booked while callers remain in
	// line, with Serve when to serve it next; Denied once the line is
	// empty. With AdmitRequest.HeadServes, whatever the Status, the same
	// of the serving the caller's return made (the caller may be one).
	Handed map[string]time.Time
	// Waiting is, for a serving of the line (as for Handed, also the
	// caller's with AdmitRequest.HeadServes), how many callers still wait
	// in the line after it; 0 otherwise.
	Waiting int
}

// defaultMaxAge is AdmitRequest.MaxAge, in horizons, for a caller with a
// Priority and no MaxAge: a minute at a horizon of one second
// (admission.DefaultMaxAge).
const defaultMaxAge = 60

// maxWeight bounds AdmitRequest.Weight.
const maxWeight = 1000

// Admit decides for a caller that can come back later; see AdmitRequest
// and AdmitStatus. It returns an error matching ErrExceedsCapacity if N is more than a rule
// can ever admit, an error matching ErrInvalidSubject for a bad subject,
// and an error matching ErrRedis if Redis fails (a FailOpen limiter
// grants instead).
func (l *Limiter) Admit(ctx context.Context, req AdmitRequest) (Admission, error) {
	if err := l.open(); err != nil {
		return Admission{}, err
	}
	if req.Tolerance < 0 {
		return Admission{}, fmt.Errorf("throttle: admit: tolerance %v: must not be negative", req.Tolerance)
	}
	if err := l.admitCosts(&req); err != nil {
		return Admission{}, err
	}
	if req.Tolerance == 0 {
		req.Tolerance = l.turnTolerance(req.N, req.Costs)
	}
	return l.mode.admit(ctx, req)
}

// turnTolerance is Admit's default Tolerance for a turn of n permits
// (per rule: per, if not nil): its length under the tightest rate rule it
// charges, cost × Period / Count, in [1ms, 1s]; the limiter's tightest
// interval for a turn that charges no rate rule (a serving, n = 0).
func (p *policy) turnTolerance(n int, per Costs) time.Duration {
	t := -1.0
	for i, r := range p.rules {
		c := per.of(i, n)
		if c == 0 || r.Algorithm.spec().holders {
			continue
		}
		if d := float64(r.Limit.Period) * float64(c) / float64(r.Limit.Count); t < 0 || d < t {
			t = d
		}
	}
	if t < 0 {
		return p.tolerance
	}
	return time.Duration(min(max(t, float64(time.Millisecond)), float64(time.Second)))
}

// admitSaid is what an Admit's one script call said, for a mode that acts
// on it (*leases): the reply, and who the caller is.
type admitSaid struct {
	rep reply
	who who
}

// admitOne is Admit's one script call over the limiter's rules.
func (l *Limiter) admitOne(ctx context.Context, req AdmitRequest) (Admission, admitSaid, error) {
	call, err := l.admitCall(&req)
	if err != nil {
		return Admission{}, admitSaid{}, err
	}
	rep, recv, err := l.call(ctx, opAdmit, call.keys, call.args)
	if re, ok := err.(*redisError); ok {
		a, err := l.admitFailed(ctx, req, re, call.serving)
		return a, admitSaid{}, err
	}
	if err != nil {
		return Admission{}, admitSaid{}, err
	}
	a, err := l.decodeAdmit(req, rep, recv, call.serving)
	if err != nil {
		return Admission{}, admitSaid{}, err
	}
	return a, admitSaid{rep: rep, who: call.who}, nil
}

// admitFailed answers an Admit that Redis failed: a serving of the line
// fails; a decision is granted without Redis if the limiter fails open.
func (l *Limiter) admitFailed(ctx context.Context, req AdmitRequest, re *redisError, serving bool) (Admission, error) {
	if serving {
		return Admission{}, re
	}
	r, err := l.failOpenOr(ctx, opAdmit, req.Subject, req.N, re.err)
	if err != nil {
		return Admission{}, err
	}
	return Admission{Status: Granted, Rule: l.rules[0].Name, At: r.at, Reservation: r}, nil
}

// who is a Caller as lua/admit.lua takes it, its defaults applied
// (Caller.resolve).
type who struct {
	booking string   // a new turn is booked under it (ARGV[b]): BookAs, else ID, as a member; '' if neither
	waiter  string   // the holder or waiter under a Concurrency rule: Waiter, else ID; '' without one
	waitAs  string   // the id held or waited under from now on, and the name a serving of the line hands back
	redeem  []string // the members to redeem, in order: ID's booking, the Receipt
}

// resolve applies c's defaults, here and only here, for limiter l; a
// limiter with a Concurrency rule needs a Waiter or an ID.
func (c Caller) resolve(l *Limiter) (who, error) {
	w := who{waitAs: cmp.Or(c.WaitAs, c.Waiter, c.BookAs, c.ID)}
	if id := cmp.Or(c.BookAs, c.ID); id != "" {
		w.booking = l.member(id)
	}
	if l.holders {
		if w.waiter = cmp.Or(c.Waiter, c.ID); w.waiter == "" {
			return who{}, errors.New("throttle: admit: a limiter with a concurrency rule needs an ID or a Waiter")
		}
		w.waitAs = cmp.Or(c.WaitAs, w.waiter)
	}
	for _, id := range [...]string{c.ID, c.Receipt} {
		if id != "" {
			w.redeem = append(w.redeem, l.member(id))
		}
	}
	return w, nil
}

// check checks c's bounds: each name at most maxReceiptLen bytes, the
// Weight at most maxWeight.
func (c Caller) check() error {
	for _, id := range [...]string{c.ID, c.Receipt, c.BookAs, c.Waiter, c.WaitAs, c.Share} {
		if len(id) > maxReceiptLen {
			return fmt.Errorf("throttle: admit: an ID, receipt, waiter or share is at most %d bytes; hash longer ones", maxReceiptLen)
		}
	}
	if c.Weight < 0 || c.Weight > maxWeight {
		return fmt.Errorf("throttle: admit: weight %d: must be between 1 and %d (0 is 1)", c.Weight, maxWeight)
	}
	if c.Priority < 0 || c.Priority > maxPriority {
		return fmt.Errorf("throttle: admit: priority %d: must be between 0 and %d", c.Priority, maxPriority)
	}
	return nil
}

// lineArg is ARGV[b+7] of lua/admit.lua for a caller of c with age bound
// maxAge (µs, 0: none): the weight alone, as before priorities, or
// "weight level max_age" (lua/line.lua).
func (c Caller) lineArg(maxAge int64) any {
	w := max(c.Weight, 1)
	if c.Priority == 0 && maxAge == 0 {
		return w
	}
	return fmt.Sprintf("%d %d %d", w, c.Priority, maxAge)
}

// maxAge returns req's age bound in µs for its line (lineArg), horizon
// µs: MaxAge, or defaultMaxAge horizons for a Priority without one.
func (req *AdmitRequest) maxAge(horizon int64) int64 {
	switch {
	case horizon == unbounded:
		return 0
	case req.MaxAge > 0:
		return req.MaxAge.Microseconds()
	case req.Priority > 0:
		return min(defaultMaxAge*horizon, maxPeriod.Microseconds())
	}
	return 0
}

// LineServing is what one serving of a subject's line did (ServeLine).
type LineServing struct {
	// Handed are the members of the line just booked, each by its name
	// (Caller.WaitAs, or Waiter, BookAs, ID: the first set) with its slot
	// on the Redis clock: wake each shortly before its slot.
	Handed map[string]time.Time
	// Next, if not zero, is when to serve the line again, on the Redis
	// clock: members still wait in it.
	Next time.Time
	// Waiting is how many members still wait in the line after this
	// serving (the line's length): 0 once it is empty. The script knows
	// it already; it costs nothing more.
	Waiting int
}

// ServeLine serves subject's line (AdmitRequest.Horizon): it books the
// turns of the members at its head that fall within horizon, in order (a
// share at a time, by weight), at most 256 in its one script call, and
// says when to serve it next. shareLimit is the line's
// AdmitRequest.ShareLimit, the zero Limit for none: every caller and every
// serving of one line should pass the same. One process should serve a
// subject's line at a time, when the last serving (or an Admission.Serve)
// said; serving it more often is harmless and books nothing new. Admit
// with N = 0 and this Horizon serves it the same way. horizon must be
// above zero. A limiter with a Concurrency rule has no line (its queue for
// places is its line) and fails: Admit with N = 0 and a Waiter brings its
// places up to date. Other errors are Admit's.
func (l *Limiter) ServeLine(ctx context.Context, subject string, horizon time.Duration, shareLimit Limit) (LineServing, error) {
	a, err := l.Admit(ctx, AdmitRequest{Subject: subject, Horizon: horizon, ShareLimit: shareLimit})
	if err != nil {
		return LineServing{}, err
	}
	s := LineServing{Handed: a.Handed, Waiting: a.Waiting}
	if a.Status == Booked && a.Lease == 0 {
		s.Next = a.Serve
	}
	return s, nil
}

// lineCapsKey is the index in lineKeys of the shares' caps (:c).
const lineCapsKey = 6

// lineKeys returns the keys of subject's line (AdmitRequest.Horizon)
// under this limiter's rules: <prefix>{<subject>}:!line(<rule>,...), its
// :e and :f hashes, and the sorted sets of its shares' limits, :h, :q, :s
// and :c (lua/line.lua). The rules are in the name because a serving books
// its members' turns under the serving limiter's rules: two limiters over
// one subject (two rules drawing on one budget, each with a limit of its
// own) have a line each, and neither books the other's members.
// Options.Line names the line in place of the rules.
func (p *policy) lineKeys(subject string) []string {
	name := p.lineName
	if name == "" {
		name = strings.Join(p.keyRules, ",")
	}
	k := key(p.prefix, escape(subject), lineSuffix+"("+name+")")
	return []string{k, k + ":e", k + ":f", k + ":h", k + ":q", k + ":s", k + ":c"}
}

// checkShareLimit checks req.ShareLimit (not the zero Limit), giving a zero Burst the
// Count. Every rule must be a bucket: a turn of a share its own limit
// holds back is booked ahead for when that limit admits it (line_serve.lua,
// take), which a bucket's state, a time, can record for any moment.
func (l *Limiter) checkShareLimit(req *AdmitRequest, horizon int64) error {
	checked, err := req.ShareLimit.CheckShare(l.rules...)
	if err != nil {
		return fmt.Errorf("throttle: admit: a share limit: %w", err)
	}
	req.ShareLimit = checked
	sl := &req.ShareLimit
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

// Tolerance is how late a caller may come back for its booking and still
// take it, when AdmitRequest.Tolerance is zero: the interval of the
// limiter's tightest rate rule (Period / Count), at least 1ms and at most
// 1s. A turn used later than that after its slot is as a late caller's:
// admission.Stack bounds the wait for the other turns of a stacked job by
// it.
func (l *Limiter) Tolerance() time.Duration { return l.tolerance }
