package admission

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"
)

// Stacked limits. A job may be under several gates at once: a per-key
// limit inside a per-tenant one, each over its own subject, whose keys may
// live in different hash slots, so that no one script call can decide
// them together. The job must hold a turn of every gate when it runs.
//
// A Stack asks its gates one after another, the lead first: the gate of
// the slowest limit (the longest throttle.Limiter.Tolerance, the interval
// of its tightest rule). The lead decides as a lone gate does (a new turn,
// its booking, or its subject's line); a job it parks has taken nothing
// from the other gates, so nothing goes back, and the job parks once. When
// the lead's turn has come, each other gate is asked for a turn within the
// lead's tolerance (a turn used later than that after its slot is a late
// one), so that every turn the job holds is used on time; in a stack that
// Meets, for its first turn no earlier than the lead's
// (throttle.AdmitRequest.NotBefore). A gate whose turn is further away
// books it under the job's ID, past any horizon (Request.BookAhead: the
// back of that gate's line would make the job lose the lead's turn each
// time it came back), the turns taken before it are given back (settled
// to nothing), and the job parks until the booked turn. So under a
// backlog that the lead's limit holds back, every other gate grants at
// once, and a job costs one park and one call per gate more than under its
// lead alone, whatever the backlog.
//
// Another gate may bind instead: a per-tenant limit over several keys
// whose keys together ask more than the tenant allows. Its jobs would
// come back from the booked turn to the back of the lead's line, and park
// again, without end. So in a stack that Meets, once such a gate's turn is
// further than the lead's horizon past the lead's turn, the jobs of
// those subjects, and of any others with that gate's subject (the
// tenant's other keys), are decided by holding turns that meet
// (stack_meet.go), in this process, until that gate no longer binds them
// (stack_leads.go):
// each gate is held, however far ahead and outside its line, the binding
// gate first and each other no earlier than the turns before it
// (throttle.AdmitRequest.NotBefore); a turn earlier
// than another's by more than its tolerance is given back and taken again
// no earlier than the latest (a bucket gives the time asked for unless its
// own turns reach past it, so they meet after one round but under a race;
// at most maxMeetRounds); turns that meet soon enough run the job, later
// ones are booked under its ID by the calls that take them (stack_meet.go:
// "Turns that book") and the job parks once, until the latest, where it
// redeems them all. A gate other than the lead that holds such a job back
// past the lead's turn becomes the lead of those subjects. A job costs
// one park and about two calls per gate (one that books, one that
// redeems), whatever the backlog, plus the calls of turns that did not
// meet (a race with another process: one more each); those parked in the
// first lead's line before park once more. Its turns are booked as far
// ahead as the backlog reaches (as a BookAhead turn is), so a changed
// limit applies to turns booked after it. A job of the lead's line that
// another gate holds back past the lead's tolerance takes the lead's turn
// again no earlier than the other's, both booked, rather than parking
// with the other's alone: back at it, it would find the lead's bucket
// moved past it by the turns booked meanwhile (NotBefore), and lose it.
//
// Holding turns that meet needs gates whose limiters are all of the bucket
// algorithms (GCRA, TokenBucket), with no concurrency rule, no share
// limit, no weights and no age bound (Stack.Meets). For other stacks, a
// backlog that another gate holds back parks its jobs more than once, and
// when every gate's limit holds a backlog the gates trade a job's turns
// without end.

// maxMeetRounds bounds how often a Stack takes a job's turns again so
// that they meet (see above).
const maxMeetRounds = 3

// Stack admits jobs that must hold a turn of each of its gates at once. It
// is safe for concurrent use.
type Stack struct {
	gates []*Gate
	lead  int  // the index of the gate asked first in its line
	meets bool // every gate can take a turn no earlier than a time

	leads *leadMemory // by the requests' subjects, decided by turns that meet: the gate held first

	holding sync.Mutex // one job's turns held at a time, so that they are taken in order
}

// NewStack returns a Stack over gates; the lead is the gate of the slowest
// limit, the first of them if several tie. It returns an error if fewer
// than two gates are given or one is nil.
func NewStack(gates ...*Gate) (*Stack, error) {
	if len(gates) < 2 {
		return nil, errors.New("admission: a stack needs at least two gates; use the gate alone")
	}
	for _, g := range gates {
		if g == nil {
			return nil, errors.New("admission: a stack's gate is nil")
		}
	}
	s := &Stack{gates: append([]*Gate(nil), gates...), meets: true, leads: newLeadMemory(maxLeads)}
	for i, g := range gates {
		if g.tolerance() > gates[s.lead].tolerance() {
			s.lead = i
		}
		s.meets = s.meets && g.canMeet()
	}
	return s, nil
}

// Gates returns the stack's gates, in NewStack's order.
func (s *Stack) Gates() []*Gate { return append([]*Gate(nil), s.gates...) }

// Lead returns the index (in NewStack's order) of the gate asked first,
// in its line: the slowest limit's.
func (s *Stack) Lead() int { return s.lead }

// Meets reports whether the stack can hold turns that meet at one time
// when another gate than the lead binds (see the package's notes on
// stacked limits): every gate's limiter has only bucket rules, and no
// concurrency rule, share limit, weights or age bound.
func (s *Stack) Meets() bool { return s.meets }

// StackDecision is Stack.Admit's answer.
type StackDecision struct {
	// Decision is, for Park, that of the gate that parked the job (Gate):
	// its turn or its line, and its wake-up. For Run, its Outcome only.
	Decision
	// Gate is, for Park and for an error, the index (in NewStack's order)
	// of the gate that parked the job or failed.
	Gate int
	// Turns are, for Run, each gate's decision, in NewStack's order: a
	// turn of each (the zero Decision for a gate whose request was the
	// zero Request). Settle each Reservation, and Release each Place,
	// once the job has run.
	Turns []Decision
}

// Admit decides for a job under every gate of the stack: reqs[i] is its
// request to gate i (its subject, cost and caller there; the zero Request
// takes no turn of that gate). It runs when every gate has given it a
// turn, and parks on the first gate whose turn is not soon enough, having
// given back the turns it took before (or, for a stack that Meets, booked
// them all for its return). Errors are the gates' (Gate.Admit), with Gate
// naming the gate; the turns taken before are given back.
func (s *Stack) Admit(ctx context.Context, reqs []Request) (StackDecision, error) {
	if len(reqs) != len(s.gates) {
		return StackDecision{}, errors.New("admission: a stack takes one request per gate")
	}
	r := s.route(reqs)
	order := s.order(reqs, r.first)
	switch {
	case len(order) == 0:
		return StackDecision{Decision: Decision{Outcome: Run}, Turns: make([]Decision, len(s.gates))}, nil
	case s.meets:
		return s.admitMeeting(ctx, reqs, order, r)
	}
	turns := make([]Decision, len(s.gates))
	bound := time.Duration(-1)
	for k, i := range order {
		req := reqs[i]
		if k > 0 {
			// A job held by an earlier gate must not lose its turn there
			// at the back of this gate's line.
			req.BookAhead = true
		}
		d, err := s.gates[i].admit(ctx, req, bound)
		if err != nil {
			s.giveBack(ctx, turns)
			return StackDecision{Gate: i}, err
		}
		if d.Outcome == Park {
			s.giveBack(ctx, turns)
			return StackDecision{Decision: d, Gate: i}, nil
		}
		turns[i] = d
		if k == 0 {
			bound = s.gates[i].tolerance()
		}
	}
	return StackDecision{Decision: Decision{Outcome: Run}, Turns: turns}, nil
}

// order returns the gates a job of reqs asks, in order: lead first, then
// the others in NewStack's order; gates given the zero Request are left
// out.
func (s *Stack) order(reqs []Request, lead int) []int {
	if reqs[lead].Subject == "" {
		lead = -1
	}
	order := make([]int, 0, len(s.gates))
	if lead >= 0 {
		order = append(order, lead)
	}
	for i := range s.gates {
		if i != lead && reqs[i].Subject != "" {
			order = append(order, i)
		}
	}
	return order
}

// leadsKey is the key of reqs' subjects in Stack.leads.
func leadsKey(reqs []Request) string {
	var b strings.Builder
	for _, r := range reqs {
		b.WriteString(r.Subject)
		b.WriteByte(0)
	}
	return b.String()
}

// route is how a Stack asks its gates for a job.
type route struct {
	first int  // the gate asked first
	held  bool // every turn held outside the lines (else first decides in its line)
	watch int  // a held job's gate learnt to bind, whether it still binds to observe; -1 for none
}

// route returns how a job of reqs asks the gates: the lead first, in its
// line, unless another gate bound such a job; then every turn held, that
// gate's first, except for the jobs that probe whether it still binds
// (leadMemory.lookup): the lead's first, watching that gate.
func (s *Stack) route(reqs []Request) route {
	if !s.meets {
		return route{first: s.lead, watch: -1}
	}
	i, probe, ok := s.leads.lookup(leadsKey(reqs), func() []string { return binderKeys(reqs) }, time.Now())
	switch {
	case !ok:
		return route{first: s.lead, watch: -1}
	case probe:
		return route{first: s.lead, held: true, watch: i}
	}
	return route{first: i, held: true, watch: -1}
}

// learnLead decides the jobs of reqs' subjects by turns that meet, gate i
// held first.
func (s *Stack) learnLead(reqs []Request, i int) {
	s.leads.learn(leadsKey(reqs), i, binderKey(i, reqs[i].Subject), time.Now())
}

// binderKeys returns the binderKey of each gate and its subject in reqs
// (leadMemory.lookup).
func binderKeys(reqs []Request) []string {
	ks := make([]string, 0, len(reqs))
	for i, r := range reqs {
		if r.Subject != "" {
			ks = append(ks, binderKey(i, r.Subject))
		}
	}
	return ks
}

// giveBack gives back the turns a job took before a gate parked it or
// failed: each settled to nothing (what the turns booked behind it leave
// room for comes back; a redeemed turn's tickets too), each place
// released, under the limiters' own bound (throttle.Limiter.Detach), so
// that a refund Redis does not answer is reported to OnRedisError.
func (s *Stack) giveBack(ctx context.Context, turns []Decision) {
	rctx, cancel := s.gates[s.lead].lim.Detach(ctx)
	defer cancel()
	for _, d := range turns {
		giveBackTurn(rctx, d)
	}
}

// giveBackTurn settles d's turn to nothing and releases its place.
func giveBackTurn(ctx context.Context, d Decision) {
	if d.Reservation != nil {
		_ = d.Reservation.Settle(ctx, 0)
	}
	_ = d.Place.Release(ctx) // nil without a place: nothing
}

// tolerance is how late a job may use the gate's turn: Options.Tolerance,
// else the limiter's.
func (g *Gate) tolerance() time.Duration {
	if g.opts.Tolerance > 0 {
		return g.opts.Tolerance
	}
	return g.lim.Tolerance()
}
