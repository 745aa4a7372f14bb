package admission

import (
	"cmp"
	"context"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A stack's turns that meet at one time (stack.go): each gate is held, the
// lead first, each other gate no earlier than the turns before it, and
// turns too early for the latest are taken again.

// meeting is one job's turns while a Stack makes them meet.
type meeting struct {
	s     *Stack
	reqs  []Request
	turns []Decision    // each gate's turn, in NewStack's order: Granted or Redeemed (a reservation), or Booked or Held (under the job's ID)
	at    time.Time     // the latest turn (Redis clock)
	by    int           // the gate whose turn it is
	moved bool          // the lead's turn was taken again, later
	wait  time.Duration // how long the job may wait here for a new turn: a later one is booked under its ID
}

// admitMeeting is Admit for a stack that Meets; order is the gates to ask,
// the lead first, which decides in its line if lined, else is held too.
func (s *Stack) admitMeeting(ctx context.Context, reqs []Request, order []int, r route) (StackDecision, error) {
	start, lined := time.Now(), !r.held
	lead := order[0]
	m := &meeting{s: s, reqs: reqs, turns: make([]Decision, len(s.gates)), by: lead}
	if lined {
		d, err := s.gates[lead].admit(ctx, reqs[lead], -1)
		if err != nil || d.Outcome == Park {
			return StackDecision{Decision: d, Gate: lead}, err
		}
		m.turns[lead], m.at = d, d.Slot
		order = order[1:]
	}
	wait, release := s.gates[lead].stackWait(ctx, reqs[lead].Subject, false, lined)
	defer release()
	m.wait = wait
	s.holding.Lock()
	unlock := sync.OnceFunc(s.holding.Unlock)
	defer unlock()
	if sd, done, err := m.holdAll(ctx, order, start); done {
		return sd, err
	}
	if r.watch >= 0 {
		m.observe(r.watch)
	}
	if behind := m.at.Sub(m.turns[lead].Slot); lined && m.by != lead && behind > s.gates[lead].tolerance() {
		if s.gates[lead].opts.Horizon <= 0 {
			unlock()
			return m.parkBehind(ctx, lead, start), nil
		}
		// The lead's turn is taken again at the other's, and both are
		// booked: a job that parked with only the other gate's turn would
		// find, back at it, the lead's bucket moved past it by the jobs
		// booked meanwhile, and lose that turn (it cannot be used late).
		if behind > s.gates[lead].opts.Horizon {
			s.learnLead(m.reqs, m.by)
		}
	}
	return m.decide(ctx, lead, lined, unlock, start)
}

// Turns that book. A job whose turns of the gates are not soon enough
// books each in the one call that takes it (hold with a wait: a turn
// later than the job can wait here is Booked under its ID, in the gate's
// bucket, as far ahead as the backlog reaches), rather than holding it
// and booking it again before it parks (Reservation.Rebook): the job
// parks once, until the latest, and comes back to redeem each turn in one
// call. The bucket's order of booked turns is the line of held jobs: a
// job booked behind others is not asked again until its turn, so a
// backlog of any depth costs a job the same calls.
//
// A tenant's subject and its keys' live in different hash slots, so a
// job's turns are several script calls, each atomic in its own slot. No
// window of any limit admits more than its limit + burst: each turn is
// taken by its own bucket's script, which counts it whether granted or
// booked, and a turn is used only within its gate's tolerance of its slot
// (a job runs once its latest turn comes, and only if every other turn
// is no earlier than that by more than its own tolerance). The binding
// gate is booked first, each other gate no earlier than the turns before
// it (NotBefore), so the others meet it unless their own buckets already
// reach past it (another process booked a later turn between the two
// calls); a turn that does not meet the latest is taken again no earlier
// than it, at most maxMeetRounds times: a reservation is settled to
// nothing first, a booking is replaced by the call that books the new
// turn under the same ID (one call, where redeeming and settling it would
// take two and give nothing back: a race leaves it behind the other
// process's later turn). Turns that still do not meet are taken anew when
// the job comes back (the earlier one lapses and gives its turn back). A
// turn given back or replaced while later ones are booked behind it is
// lost to its bucket: unused, never over the limit.

// booked reports whether one of the turns is booked for later (the job
// parks).
func (m *meeting) booked() bool {
	for _, d := range m.turns {
		if d.Outcome == Run && (d.Status == throttle.Booked || d.Status == throttle.Held) {
			return true
		}
	}
	return false
}

// holdAll holds a turn of each gate of order, each no earlier than the
// turns before it, and reports done with the job's decision if one failed
// or holds a turn the job came back too early for (it parks on it).
func (m *meeting) holdAll(ctx context.Context, order []int, start time.Time) (StackDecision, bool, error) {
	s := m.s
	for k, i := range order {
		g := s.gates[i]
		a, err := g.hold(ctx, m.reqs[i], m.at, m.wait, g.opts.EarlyWait)
		if err != nil {
			s.giveBack(ctx, m.turns)
			return StackDecision{Gate: i}, true, err
		}
		if a.Status == throttle.Held && k == 0 && m.at.IsZero() {
			// Back early for a turn booked for it before, and nothing
			// taken yet: park on it. (Held later, it is a booked turn
			// like the others: the turns before it are booked too.)
			return StackDecision{Decision: g.parkOn(ctx, m.reqs[i], heldDecision(a), start), Gate: i}, true, nil
		}
		m.take(i, a)
	}
	return StackDecision{}, false, nil
}

// observe tells the stack's memory whether gate b, learnt to bind these
// subjects, still bound this job, whose lead turn was held first, no
// earlier than now: b's turn, held no earlier than it, came later than
// the lead's tolerance from now and later than the lead's. (Held first,
// b's turn tells nothing: the turns given back to meet push its bucket's
// own turns back, so it comes no earlier than the lead's however little
// it binds.) Redeemed turns say nothing of the load, and are not counted.
func (m *meeting) observe(b int) {
	d, l := m.turns[b], m.turns[m.s.lead]
	if d.Status == throttle.Redeemed || l.Status == throttle.Redeemed {
		return
	}
	bound := d.Delay > m.s.gates[m.s.lead].tolerance() && d.Slot.After(l.Slot)
	m.s.leads.observe(leadsKey(m.reqs), bound, time.Now())
}

// parkBehind parks a job that another gate holds back past its turn of
// the lead's, for a lead without a line (a negative Horizon; with one,
// the lead's turn is taken again at the other's: see Stack). The lead's
// turn is given back, the others kept, and the job parks until the
// latest, as before NotBefore.
// If the other gate holds it back further than the lead's line reaches,
// it binds: the jobs of these subjects hold turns that meet, that gate's
// first, until it no longer binds them (stack_leads.go). The lead's turn
// is given back under its limiter's own bound (as giveBack does).
func (m *meeting) parkBehind(ctx context.Context, lead int, start time.Time) StackDecision {
	s := m.s
	if m.at.Sub(m.turns[lead].Slot) > s.gates[lead].opts.Horizon {
		s.learnLead(m.reqs, m.by)
	}
	rctx, cancel := s.gates[lead].lim.Detach(ctx)
	giveBackTurn(rctx, m.turns[lead])
	cancel()
	m.turns[lead] = Decision{}
	return m.park(ctx, start)
}

// decide makes the held turns meet, and runs the job once they come if
// that is soon enough, else books them and parks it; unlock ends the
// stack's holding once no more turns are taken.
func (m *meeting) decide(ctx context.Context, lead int, lined bool, unlock func(), start time.Time) (StackDecision, error) {
	s := m.s
	// A job that runs now uses each turn within its gate's tolerance; one
	// that parks comes back a little after the latest turn, so its turns
	// must meet within half of it.
	wait := m.wait
	if !lined && m.redeemed() {
		wait = max(wait, s.gates[lead].opts.EarlyWait)
	}
	err := m.meet(ctx, lead, 1)
	parks := err == nil && (m.booked() || time.Until(m.latestAt()) > wait)
	if parks {
		err = m.meet(ctx, lead, 2)
	}
	unlock()
	if err != nil {
		s.giveBack(ctx, m.turns)
		return StackDecision{Gate: m.by}, err
	}
	if m.moved && m.by != lead {
		// Another gate held the job back past the lead's turn: it binds,
		// and leads the next jobs of these subjects.
		s.learnLead(m.reqs, m.by)
	}
	if parks {
		return m.park(ctx, start), nil
	}
	if err := sleepUntil(ctx, m.latestAt()); err != nil {
		s.giveBack(ctx, m.turns)
		return StackDecision{Gate: m.by}, err
	}
	now := time.Now()
	for i := range m.turns {
		if m.turns[i].Outcome == Run {
			m.turns[i].At, m.turns[i].Waited = now, now.Sub(start)
		}
	}
	return StackDecision{Decision: Decision{Outcome: Run, Admission: throttle.Admission{At: now}, Waited: now.Sub(start)}, Turns: m.turns}, nil
}

// stackWait is how long a stacked job led by this gate may wait where it
// is for its turns: within the gate's tolerance if the lead's turn, from
// its line, has come (lined); else as a lone job would (admit): EarlyWait
// for turns all booked for it before (redeemed), MaxWait in one of the
// subject's waiting slots for new ones, else none. Never past ctx's
// deadline. Call release when the job no longer waits.
func (g *Gate) stackWait(ctx context.Context, subject string, redeemed, lined bool) (wait time.Duration, release func()) {
	release = func() {}
	switch {
	case lined:
		wait = g.tolerance()
	case redeemed:
		wait = g.opts.EarlyWait
	case g.takeSlot(subject):
		wait, release = g.opts.MaxWait, func() { g.releaseSlot(subject) }
	}
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, max(time.Until(dl)-wakeSlack, 0))
	}
	return wait, release
}

// take records gate i's turn a, the latest so far if it is.
func (m *meeting) take(i int, a throttle.Admission) {
	m.turns[i] = Decision{Outcome: Run, Admission: a}
	if a.Slot.After(m.at) {
		m.at, m.by = a.Slot, i
	}
}

// redeemed reports whether every turn was booked for the job before.
func (m *meeting) redeemed() bool {
	for _, d := range m.turns {
		if d.Outcome == Run && d.Status != throttle.Redeemed {
			return false
		}
	}
	return true
}

// meet takes again, no earlier than the latest turn, each turn earlier
// than its gate's tolerance / div before it, at most maxMeetRounds times.
func (m *meeting) meet(ctx context.Context, lead int, div time.Duration) error {
	rctx, cancel := m.s.gates[lead].lim.Detach(ctx)
	defer cancel()
	for range maxMeetRounds {
		moved := false
		for i, d := range m.turns {
			g := m.s.gates[i]
			if d.Outcome != Run || !d.Slot.Before(m.at.Add(-g.tolerance()/div)) {
				continue
			}
			m.moved = m.moved || i == lead
			req, wait := m.reqs[i], m.wait
			if as := cmp.Or(req.BookAs, req.ID); d.Reservation == nil && as != "" {
				// A booking is replaced in the call that takes the new
				// turn, booked under the same name (BookAs, else ID) and
				// redeeming nothing, unless it is due at once: a turn
				// granted to wait for here would leave the old booking
				// in place, and if the job then parked, its Rebook would
				// find the name taken.
				req.ID, req.Receipt, req.BookAs, wait = "", "", as, 0
			} else {
				giveBackTurn(rctx, d)
			}
			m.turns[i] = Decision{}
			a, err := g.hold(ctx, req, m.at, wait, 0)
			if err != nil {
				m.by = i
				return err
			}
			m.take(i, a)
			moved = true
		}
		if !moved {
			return nil
		}
	}
	return nil // turns that still do not meet: the earlier ones are taken anew on the job's return
}

// latestAt is when the latest of the turns comes, on the local clock.
func (m *meeting) latestAt() time.Time {
	var t time.Time
	for _, d := range m.turns {
		if d.Outcome == Run && d.At.After(t) {
			t = d.At
		}
	}
	return t
}

// park books every turn under the job's ID for its return
// (throttle.Reservation.Rebook) and parks it until the latest, on that
// turn's gate. A turn that cannot be booked is given back, and taken anew
// when the job comes back.
func (m *meeting) park(ctx context.Context, start time.Time) StackDecision {
	rctx, cancel := m.s.gates[m.by].lim.Detach(ctx)
	defer cancel()
	for _, d := range m.turns {
		// (A Booked or Held turn is booked under the job's ID already.)
		if d.Reservation != nil {
			if ok, _ := d.Reservation.Rebook(rctx); !ok {
				_ = d.Reservation.Settle(rctx, 0)
			}
		}
	}
	last := m.turns[m.by]
	d := Decision{Admission: throttle.Admission{Status: throttle.Booked, Rule: last.Rule, At: last.At, Slot: m.at}}
	return StackDecision{Decision: m.s.gates[m.by].parkOn(ctx, m.reqs[m.by], d, start), Gate: m.by}
}

// heldDecision is the Park decision of a turn held for a job back early.
func heldDecision(a throttle.Admission) Decision {
	return Decision{Admission: throttle.Admission{Status: a.Status, Rule: a.Rule, At: a.At, Slot: a.Slot}}
}

// parkOn makes d a Park decision of the gate's for req, its wake-up
// recorded in Options.Parking (as admit does).
func (g *Gate) parkOn(ctx context.Context, req Request, d Decision, start time.Time) Decision {
	d.Outcome, d.Reservation = Park, nil
	if g.opts.Parking != nil {
		d.Woken, d.ParkErr = g.opts.Parking.park(ctx, g.opts.Name, req, d)
	}
	d.Waited = time.Since(start)
	return d
}

// hold takes a turn of the gate for req no earlier than notBefore (Redis
// clock; the zero time for now), however far ahead and outside the
// subject's line, without waiting for it: Granted with a reservation to
// Rebook or give back if within wait (a negative wait: however far);
// else Booked under the job's ID; Redeemed if the job has a booking due
// within early; Held if it has a later one.
func (g *Gate) hold(ctx context.Context, req Request, notBefore time.Time, wait, early time.Duration) (throttle.Admission, error) {
	req.BookAhead = true
	if req.ID == "" && req.BookAs == "" {
		wait = -1 // nothing to book under: held however far, as a reservation
	}
	lr := g.limiterRequest(req, wait, early)
	lr.Horizon, lr.NotBefore = 0, notBefore
	return g.lim.Admit(ctx, lr)
}

// canMeet reports whether the gate can take a turn no earlier than a
// time (hold): its limiter has only bucket rules, and it has no share
// limit, weights or age bound (which need its line).
func (g *Gate) canMeet() bool {
	if g.leased || g.opts.ShareLimit != (throttle.Limit{}) || len(g.opts.Weights) > 0 || g.opts.MaxAge > 0 {
		return false
	}
	for _, r := range g.lim.Rules() {
		if r.Algorithm != throttle.GCRA && r.Algorithm != throttle.TokenBucket {
			return false
		}
	}
	return true
}
