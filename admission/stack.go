package admission

import (
	"context"
	"errors"
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
// one), so that every turn the job holds is used on time. A gate whose
// turn is further away books it under the job's ID, past any horizon
// (Request.BookAhead: the back of that gate's line would make the job lose
// the lead's turn each time it came back), the turns taken before it are
// given back (settled to nothing), and the job parks until the booked
// turn. So under a backlog that the lead's limit holds back, every other
// gate grants at once, and a job costs one park and one call per gate more
// than under its lead alone, whatever the backlog.
//
// Not for a backlog that another gate holds back: a per-tenant limit over
// several keys whose keys together ask more than the tenant allows. Its
// jobs come back from the lead's turns to a gate booked ahead, park on
// it, and take a new turn of the lead when they come back, so they park
// more than once; and when every gate's limit holds a backlog, the gates
// trade a job's turns without end. Booking each gate's turn against the
// others' (a turn no earlier than a given time) needs the limiter's
// scripts to book at a given time, which they do not yet.

// Stack admits jobs that must hold a turn of each of its gates at once. It
// is safe for concurrent use.
type Stack struct {
	gates []*Gate
	lead  int // the index of the gate asked first
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
	s := &Stack{gates: append([]*Gate(nil), gates...)}
	for i, g := range gates {
		if g.tolerance() > gates[s.lead].tolerance() {
			s.lead = i
		}
	}
	return s, nil
}

// Gates returns the stack's gates, in NewStack's order.
func (s *Stack) Gates() []*Gate { return append([]*Gate(nil), s.gates...) }

// Lead returns the index (in NewStack's order) of the gate asked first.
func (s *Stack) Lead() int { return s.lead }

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
// given back the turns it took before. Errors are the gates' (Gate.Admit),
// with Gate naming the gate; the turns taken before are given back.
func (s *Stack) Admit(ctx context.Context, reqs []Request) (StackDecision, error) {
	if len(reqs) != len(s.gates) {
		return StackDecision{}, errors.New("admission: a stack takes one request per gate")
	}
	lead := s.Lead()
	order := make([]int, 0, len(s.gates))
	order = append(order, lead)
	for i := range s.gates {
		if i != lead {
			order = append(order, i)
		}
	}
	turns := make([]Decision, len(s.gates))
	bound, first := time.Duration(-1), true
	for _, i := range order {
		req := reqs[i]
		if req.Subject == "" {
			continue
		}
		if !first {
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
		if first {
			first, bound = false, s.gates[i].tolerance()
		}
	}
	return StackDecision{Decision: Decision{Outcome: Run}, Turns: turns}, nil
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
		if d.Reservation != nil {
			_ = d.Reservation.Settle(rctx, 0)
		}
		_ = d.Place.Release(rctx) // nil without a place: nothing
	}
}

// tolerance is how late a job may use the gate's turn: Options.Tolerance,
// else the limiter's.
func (g *Gate) tolerance() time.Duration {
	if g.opts.Tolerance > 0 {
		return g.opts.Tolerance
	}
	return g.lim.Tolerance()
}
