package throttle

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The scripts' replies, decoded in one place: every status a script
// decides, and what it becomes for the caller, is in this file. decide.lua
// (allow.lua, prepay.lua and admit.lua's new turns) replies ok or not;
// admit.lua replies one of the admit statuses below; refund.lua,
// settle.lua and pause.lua reply a number their callers read themselves.

// reply is the answer of lua/decide.lua to allow, reserve, prepay, admit and
// atmost: {status, deciding rule (1-based), remaining, delay µs, reset
// µs, Redis now µs, tickets…}; atmost adds the permits it took.
type reply struct {
	Result
	status   int64 // ok (1/0), or admit's status (admit.go)
	redisNow int64 // µs of Redis TIME when the script ran
	raw      []any
}

// tickets returns the refund tickets of an admitted reply, one per rule;
// nil if it has none (n = 0 charged nothing). Built on demand: Allow drops
// them, and its hot path allocates only what go-redis needs. The fast
// bucket script replies its one ticket as an integer, the time to act in
// whole µs, which is the general script's "<w> 0" (lua/bucket_fast.lua).
func (r reply) tickets(rules int) []string {
	if len(r.raw) < 6+rules {
		return nil
	}
	t := make([]string, rules)
	for i := range t {
		switch v := r.raw[6+i].(type) {
		case string:
			t[i] = v
		case int64:
			t[i] = strconv.FormatInt(v, 10) + " 0"
		}
	}
	return t
}

// parse reads a reply; it fails only for one the scripts cannot have sent.
func (p *policy) parse(raw []any) (reply, error) {
	if len(raw) < 6 {
		return reply{}, badReply(raw)
	}
	var ints [6]int64
	for i := range ints {
		v, ok := raw[i].(int64)
		if !ok {
			return reply{}, badReply(raw)
		}
		ints[i] = v
	}
	decider := int(ints[1]) - 1
	if decider < 0 || decider >= len(p.rules) {
		return reply{}, badReply(raw)
	}
	return reply{
		Result: Result{
			Allowed:    ints[0] == 1,
			Rule:       p.rules[decider].Name,
			Limit:      p.rules[decider].Limit,
			Remaining:  int(ints[2]),
			RetryAfter: time.Duration(ints[3]) * time.Microsecond,
			ResetAfter: time.Duration(ints[4]) * time.Microsecond,
		},
		status: ints[0], redisNow: ints[5], raw: raw,
	}, nil
}

// parseAllow reads the reply to a plain allow of n permits (AllowN, which
// keeps only the Result): the fast bucket script's one integer
// (compactResult) or, from the general script, the array.
func (p *policy) parseAllow(raw any, n int) (reply, error) {
	switch v := raw.(type) {
	case int64:
		res := p.compactResult(v, n)
		var status int64
		if res.Allowed {
			status = 1
		}
		return reply{Result: res, status: status}, nil
	case []any:
		return p.parse(v)
	}
	return reply{}, fmt.Errorf("throttle: unexpected script reply %v", raw)
}

// compactResult is the Result of lua/bucket_fast.lua's answer v to an
// allow of n permits sent as answerOnly: v = dw if admitted, -1 - dw if
// not, where dw is the time from Redis's now to the bucket's TAT (after
// the request if admitted, before it if not). The rest follows as the
// script computes it in its array reply: with T the interval and B =
// burst·T the bucket's depth, both in µs, remaining is ⌊(B - dw)/T⌋ (0 in
// debt) and a refusal's delay, until the request's time to act, is
// dw + n·T - B.
func (p *policy) compactResult(v int64, n int) Result {
	r := p.rules[0]
	T, burst := p.ruleArgs[2].(int64), p.ruleArgs[3].(int64) // fastLine's
	B := burst * T
	res := Result{Allowed: v >= 0, Rule: r.Name, Limit: r.Limit}
	dw := v
	if !res.Allowed {
		dw = -1 - v
		res.RetryAfter = time.Duration(dw+int64(n)*T-B) * time.Microsecond
	}
	if left := B - dw; left > 0 {
		res.Remaining = int(left / T)
	}
	res.ResetAfter = time.Duration(dw) * time.Microsecond
	return res
}

// badReply is the error for a reply the scripts cannot have sent (built only
// then: formatting a reply costs more than the rest of parsing it).
func badReply(raw []any) error {
	return fmt.Errorf("throttle: unexpected script reply %v", raw)
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

// Reply statuses of lua/admit.lua, named as lua/status.lua names them
// (admit.lua's header says when each is sent).
const (
	admitDenied   = 0
	admitGranted  = 1
	admitBooked   = 2
	admitRedeemed = 3
	admitHeld     = 4
	admitQueued   = 5 // waiting for a place of the Concurrency rule
	admitInLine   = 6 // waiting in the subject's line (AdmitRequest.Horizon)
)

// admitStatuses is the one table from admit.lua's statuses to what an
// Admit caller is told: the AdmitStatus, whether Admission.Rule names the
// deciding rule, and whether the caller waits in the subject's line.
// (A queued caller's Admission.Lease is set by the concurrency mode.)
// admission/status.go carries each row on up the layers: what a gate
// makes of it and what the worker calls it.
var admitStatuses = [...]struct {
	status AdmitStatus
	rule   bool
	inLine bool
}{
	admitDenied:   {Denied, true, false},
	admitGranted:  {Granted, true, false},
	admitBooked:   {Booked, true, false},
	admitRedeemed: {Redeemed, false, false},
	admitHeld:     {Held, false, false},
	admitQueued:   {Booked, true, false},
	admitInLine:   {Booked, true, true},
}

// decodeAdmit reads lua/admit.lua's reply rep, received at recv, to req:
// each status becomes the caller's AdmitStatus here (admitStatuses). A
// serving of the line also reads the members it booked.
func (l *Limiter) decodeAdmit(req AdmitRequest, rep reply, recv time.Time, serving bool) (Admission, error) {
	if rep.status < 0 || rep.status >= int64(len(admitStatuses)) {
		return Admission{}, badReply(rep.raw)
	}
	row, res := admitStatuses[rep.status], rep.Result
	a := Admission{
		Status: row.status,
		InLine: row.inLine,
		Delay:  res.RetryAfter,
		Slot:   time.UnixMicro(rep.redisNow).Add(res.RetryAfter),
	}
	if row.rule {
		a.Rule = res.Rule
	}
	a.At = l.clock.wake(recv, rep.redisNow, a.Delay)
	switch rep.status {
	case admitGranted:
		a.Reservation = &Reservation{lim: l, subject: req.Subject, n: req.N, per: req.Costs, tickets: rep.tickets(len(l.rules)), delay: a.Delay, at: a.At, booked: rep.redisNow,
			slot: a.Slot, tol: req.Tolerance.Microseconds()}
		if id := cmp.Or(req.BookAs, req.ID); id != "" && req.ShareLimit == (Limit{}) && !l.holders {
			a.Reservation.rebookAs = l.member(id) // Rebook books it under that for the caller's return
		}
		if req.ShareLimit != (Limit{}) && len(rep.raw) > 6+len(l.rules) {
			// Its share's turn, given back with the rules' (lua/refund.lua).
			a.Reservation.share, _ = rep.raw[6+len(l.rules)].(string)
		}
	case admitRedeemed:
		if t, booked := redeemedTickets(rep.raw, len(l.rules)); t != nil {
			// To settle (Reservation.Settle); the turn is spent, so
			// Cancel gives nothing back.
			a.Reservation = &Reservation{lim: l, subject: req.Subject, n: req.N, per: req.Costs, tickets: t, delay: a.Delay, at: a.At, spent: true, booked: booked,
				slot: a.Slot, tol: req.Tolerance.Microseconds()}
			if id := cmp.Or(req.BookAs, req.ID); id != "" {
				a.Reservation.rebookAs = l.member(id) // the booking it comes back for
			}
		}
	case admitInLine:
		if serve, _ := rep.raw[4].(int64); serve >= 0 {
			a.Serve = time.UnixMicro(rep.redisNow + serve)
		}
	}
	if !serving && l.headsServe(req) {
		memberServed(&a, rep.raw, len(l.rules))
	}
	if serving {
		a.Handed = handed(rep.raw, len(l.rules))
		if a.Status == Booked {
			// lua/line_serve.lua: the members left in line in place of
			// the remaining permits.
			a.Serve, a.Rule, a.Waiting = a.Slot, "", res.Remaining
		}
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

// memberServed reads into a what the caller's serving of its line did
// (AdmitRequest.HeadServes; lua/line_serve.lua, tail), after the
// tickets' places: the members left in line (Waiting), the next head
// (Head; its return serves the line) and when (Serve), or ” and when to
// serve the line, and the members booked (Handed). A reply without it
// (no serving, and the caller did not start the line) leaves a as it is.
func memberServed(a *Admission, raw []any, nrules int) {
	i := 6 + nrules
	if len(raw) < i+3 {
		return
	}
	left, _ := raw[i].(int64)
	a.Waiting = int(left)
	a.Head, _ = raw[i+1].(string)
	if us, err := strconv.ParseInt(fmt.Sprint(raw[i+2]), 10, 64); err == nil {
		a.Serve = time.UnixMicro(us)
	}
	a.Handed = handed(raw, nrules+3)
}

// redeemedTickets returns the tickets admit's reply carries for a redeemed
// booking or receipt (one string: a line per rule, then the Redis time of
// the booking and, after a space, its costs), and that time; nil if it has none (recorded before tickets
// were kept, or under other rules).
func redeemedTickets(raw []any, rules int) ([]string, int64) {
	if len(raw) < 7 {
		return nil, 0
	}
	s, ok := raw[6].(string)
	if !ok {
		return nil, 0
	}
	t := strings.Split(s, "\n")
	if len(t) != rules+1 {
		return nil, 0
	}
	// The booking's Redis time, then (if booked by this version) its costs.
	at, _, _ := strings.Cut(t[rules], " ")
	booked, err := strconv.ParseInt(at, 10, 64)
	if err != nil {
		return nil, 0
	}
	return t[:rules], booked
}
