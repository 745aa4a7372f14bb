package throttle

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
)

// Rules over several subjects. A rule with a Subject limits that subject
// whatever the caller's: a global limit beside a per-tenant one. New
// splits such a limiter into parts, one per subject in the order of their
// first rule, each a Limiter over the rules of one subject; the parts are
// acquired one after another and a request that a later part refuses
// gives back what the earlier parts took (undo: even after their time to
// act, since the caller never acted), so a refused request keeps nothing.

// part is the rules of a limiter over one subject: the caller's (subject
// "") or a fixed one.
type part struct {
	lim     *Limiter
	subject string
}

// of returns the subject the part charges for a caller's subject.
func (p part) of(subject string) string {
	if p.subject == "" {
		return subject
	}
	return p.subject
}

// errOneSubject is PrepayN's and AllowAtMost's error on a limiter whose
// rules are over several subjects.
var errOneSubject = errors.New("throttle: PrepayN and AllowAtMost need every rule over one subject (no Rule.Subject apart from the caller's)")

// severalSubjects is the mode of a limiter whose rules are over several
// subjects: its parts, each a Limiter over one subject's rules.
type severalSubjects struct {
	l    *Limiter
	ps   []part
	lead *atomic.Int32 // the part that set a request's turn last (acquireParts)
	// buckets: every rule is GCRA or TokenBucket, which an Admit's
	// NotBefore places (admitParts).
	buckets bool
}

func (m severalSubjects) allow(ctx context.Context, subject string, n int) (Result, error) {
	return m.allowParts(ctx, subject, n)
}

func (m severalSubjects) acquire(ctx context.Context, subject string, n int, reserve bool) (*Reservation, error) {
	return m.acquireParts(ctx, subject, n, reserve)
}

func (m severalSubjects) wait(ctx context.Context, subject string, n int) (*Place, error) {
	return nil, m.l.acquireAndWait(ctx, subject, n)
}

func (m severalSubjects) admit(ctx context.Context, req AdmitRequest) (Admission, error) {
	return m.admitParts(ctx, req)
}

func (m severalSubjects) parts() []part { return m.ps }
func (m severalSubjects) forget(string) {}

func (m severalSubjects) close() {
	for _, p := range m.ps {
		_ = p.lim.Close()
	}
}

// oneSubject reports whether every rule of l is over the caller's subject.
func (l *Limiter) oneSubject() bool {
	ps := l.mode.parts()
	return len(ps) == 1 && ps[0].lim == l
}

// splitParts builds the parts of a limiter whose rules name subjects,
// or returns nil if every rule is over the caller's subject.
func splitParts(l *Limiter) ([]part, error) {
	var order []string
	bySubject := map[string][]Rule{}
	for _, r := range l.rules {
		s := r.Subject
		if _, seen := bySubject[s]; !seen {
			order = append(order, s)
		}
		r.Subject = ""
		bySubject[s] = append(bySubject[s], r)
	}
	if len(order) == 1 && order[0] == "" {
		return nil, nil
	}
	parts := make([]part, len(order))
	for i, s := range order {
		lim, err := New(l.rdb, l.opts, bySubject[s]...)
		if err != nil {
			return nil, err
		}
		parts[i] = part{lim: lim, subject: s}
	}
	return parts, nil
}

// allowParts is AllowN over the parts: every part grants n now, or none
// keeps anything. The Result is the first refusing part's, or, if all
// allowed, that of the part with the fewest remaining.
func (m severalSubjects) allowParts(ctx context.Context, subject string, n int) (Result, error) {
	held := make([]*Reservation, 0, len(m.ps))
	var best Result
	for i, p := range m.ps {
		res, r, err := p.lim.decide(ctx, opAllow, p.of(subject), n, unbounded, true, nil)
		if err != nil || !res.Allowed {
			undoAll(ctx, held)
			return res, err
		}
		held = append(held, r)
		if i == 0 || res.Remaining < best.Remaining {
			best = res
		}
	}
	return best, nil
}

// acquireParts books n permits from every part without sleeping (bucket
// parts reserve their slot; window parts wait their turn here) and
// returns one reservation holding them all, at one turn: each part's
// permits are charged at the turn the request acts, the latest of the
// parts' own. Booked at its own earlier time instead, a part would hold
// the permit before it is used, and its next requests, held back by
// another part, would then act closer together than its rules allow (a
// tenant's turns booked at its own rate, acted on at the busier global
// rule's). So each part after the first is booked no earlier than the
// turn so far (reserveAt); a part booked before a later part's turn is
// given back and booked again at it, until every part meets the turn
// (maxMeetPasses bounds it; past that the request acts at the latest
// turn, as before meeting was done). The part that set the turn last is
// booked first next time: the binding part (usually the shared one),
// first, leaves the others one call each. If a part fails, the parts
// already held are given back.
func (m severalSubjects) acquireParts(ctx context.Context, subject string, n int, reserve bool) (*Reservation, error) {
	held := make([]*Reservation, len(m.ps))
	order := m.order()
	var turn int64 // the latest turn so far, µs of Redis time; 0: none yet
	for pass := 0; pass < maxMeetPasses && !met(held, turn); pass++ {
		for _, i := range order {
			p, h := m.ps[i], held[i]
			if h != nil && !h.before(turn) {
				continue
			}
			var r *Reservation
			var err error
			switch {
			case turn > 0:
				if h != nil {
					h.cancelDetached(ctx, true) // given back before the part books again
					held[i] = nil
				}
				r, err = p.lim.reserveAt(ctx, p.of(subject), n, turn)
			case reserve:
				r, err = p.lim.ReserveN(ctx, p.of(subject), n)
			default:
				r, err = p.lim.acquire(ctx, p.of(subject), n)
			}
			if err != nil {
				undoAll(ctx, held)
				return nil, err
			}
			held[i] = r
			if s, ok := r.turn(); ok && s > turn {
				turn = s
				m.lead.Store(int32(i))
			}
		}
	}
	return joinParts(m.l, subject, n, held), nil
}

// met reports whether every part is held at turn (none held: not yet).
func met(held []*Reservation, turn int64) bool {
	for _, h := range held {
		if h == nil || h.before(turn) {
			return false
		}
	}
	return true
}

// maxMeetPasses bounds the passes of acquireParts: the first books every
// part, each later one books again the parts a later turn left behind.
const maxMeetPasses = 4

// order is the order acquireParts books the parts in: the part that set
// the turn last first, then the others in their order.
func (m severalSubjects) order() []int {
	lead := int(m.lead.Load())
	order := make([]int, 0, len(m.ps))
	order = append(order, lead)
	for i := range m.ps {
		if i != lead {
			order = append(order, i)
		}
	}
	return order
}

// turn is the reservation's turn on the Redis clock (µs), and false for
// one made without Redis (fail open), which has none.
func (r *Reservation) turn() (int64, bool) {
	if r.tickets == nil || r.booked < 0 {
		return 0, false
	}
	return r.booked + r.delay.Microseconds(), true
}

// before reports whether the reservation's turn is earlier than turn.
func (r *Reservation) before(turn int64) bool {
	s, ok := r.turn()
	return ok && s < turn
}

// joinParts returns one reservation holding every part's, to act at the
// latest of their times.
func joinParts(l *Limiter, subject string, n int, held []*Reservation) *Reservation {
	r := &Reservation{lim: l, subject: subject, n: n, parts: held, at: held[0].at}
	for _, h := range held[1:] {
		if h.at.After(r.at) {
			r.at = h.at
		}
	}
	return r
}

// admitParts is Admit over the parts. A caller over several subjects is
// not booked: every part takes a new turn within req.Wait, or none keeps
// anything and the request is Denied, with the delay of the part that
// refused. A receipt or booking of the caller is not looked up. Where
// AdmitRequest.NotBefore can place a turn (bucket rules in every part, no
// Horizon, no ShareLimit), the parts meet at one turn as acquireParts's
// do; otherwise each part is charged at its own turn and the request acts
// at the latest.
func (m severalSubjects) admitParts(ctx context.Context, req AdmitRequest) (Admission, error) {
	held := make([]*Reservation, len(m.ps))
	got := make([]Admission, len(m.ps))
	meets := m.buckets && req.Horizon == 0 && req.ShareLimit == (Limit{})
	turn := req.NotBefore
	for pass := 0; pass < maxMeetPasses; pass++ {
		for _, i := range m.order() {
			p := m.ps[i]
			if held[i] != nil && (!meets || !got[i].Slot.Before(turn)) {
				continue
			}
			sub := req
			sub.Subject, sub.ID, sub.Receipt, sub.BookAs = p.of(req.Subject), "", "", ""
			if meets {
				sub.NotBefore = turn
			}
			if held[i] != nil {
				held[i].cancelDetached(ctx, true) // given back before the part books again
				held[i] = nil
			}
			a, err := p.lim.Admit(ctx, sub)
			if err != nil || a.Status != Granted {
				undoAll(ctx, held)
				if err == nil {
					a.Status, a.Reservation = Denied, nil
				}
				return a, err
			}
			held[i], got[i] = a.Reservation, a
			if meets && a.Reservation.tickets == nil {
				got[i].Slot = turn // admitted without Redis: no turn to meet
			}
			if a.Slot.After(turn) {
				turn = a.Slot
				m.lead.Store(int32(i))
			}
		}
		if !meets || slices.IndexFunc(got, func(a Admission) bool { return a.Slot.Before(turn) }) < 0 {
			break
		}
	}
	last := got[0]
	for _, a := range got[1:] {
		if a.At.After(last.At) {
			last = a
		}
	}
	last.Reservation = joinParts(m.l, req.Subject, req.N, held)
	return last, nil
}

// undoAll gives back every reservation (nil: none held), even after ctx has ended, and
// even after its time to act: the caller did not act on any.
func undoAll(ctx context.Context, held []*Reservation) {
	for _, r := range held {
		if r != nil {
			r.cancelDetached(ctx, true)
		}
	}
}
