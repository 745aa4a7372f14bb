package httpthrottle

import (
	"context"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// PacedRecheck is how long a paced Transport (Options.Paced) sends the
// requests of a subject whose upstream taught nothing without departures:
// then one departs again, which reads what the fleet learned meanwhile.
const PacedRecheck = 30 * time.Second

// pacedSubjects is what a Transport knows of each subject's upstream,
// and when it last departed for it or heard its answer: a paced one
// (Options.Paced) sends by it, and every one reports the slowest rate
// learned lately (Transport.LearnedRate).
type pacedSubjects struct {
	mu   sync.Mutex
	seen map[string]pacedSubject
}

type pacedSubject struct {
	at      time.Time // the last departure booked
	learned throttle.Learned
	since   time.Time // when this process first saw learned.Rate above 0 (zero: it is 0)
}

// now returns a departure that leaves at once for a subject whose
// upstream taught no rate (as far as this process knows, from an answer
// within PacedRecheck), and false for any other: its request departs on
// the upstream schedule.
func (p *pacedSubjects) now(subject string) (*throttle.Departure, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.seen[subject]
	if !ok || !p.nowOK(s) {
		return nil, false
	}
	return throttle.DepartNow(s.learned), true
}

// nowOK is now's condition on what is known of the subject, s.
func (p *pacedSubjects) nowOK(s pacedSubject) bool {
	return s.learned.Rate <= 0 && time.Since(s.at) <= PacedRecheck
}

// saw records a departure booked for subject, with what it carried. The
// probe's carries nothing yet: its answer is recorded (learned) instead,
// and until then the subject's requests depart (and wait for it).
func (p *pacedSubjects) saw(subject string, d *throttle.Departure) {
	if d.Probe {
		return
	}
	p.learned(subject, d.Learned)
}

// learned records what is known of subject's upstream after a departure
// or an answer.
func (p *pacedSubjects) learned(subject string, l throttle.Learned) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.seen[subject]; !ok && len(p.seen) >= maxPacedSubjects {
		clear(p.seen) // many subjects: each departs once more
	}
	now := time.Now()
	s := pacedSubject{at: now, learned: l}
	if old, ok := p.seen[subject]; ok && old.learned.Rate > 0 {
		s.since = old.since
	}
	if l.Rate <= 0 {
		s.since = time.Time{}
	} else if s.since.IsZero() {
		s.since = now
	}
	p.seen[subject] = s
}

// maxPacedSubjects bounds the memory of a Transport's pacedSubjects.
const maxPacedSubjects = 10000

// RecentLearned is how lately a Transport must have sent for a subject
// for its learned rate to count in Transport.LearnedRate.
const RecentLearned = time.Minute

// slowest returns the lowest learned rate (requests per second) of the
// subjects seen within recent, 0 if none has one.
func (p *pacedSubjects) slowest(recent time.Duration) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	rate := 0.0
	for _, s := range p.seen {
		if r := s.learned.Rate; r > 0 && time.Since(s.at) <= recent && (rate == 0 || r < rate) {
			rate = r
		}
	}
	return rate
}

// A Turn is the turn of Limiter.Admit a paced request (Options.Paced) is
// sent on, as the worker middleware reports it (admission.Wait).
type Turn struct {
	// At is the turn on the local monotonic clock (admission.Wait.At):
	// when the caller was to act on it.
	At time.Time
	// Decided is when Admit was asked for it, on the local clock, or
	// later (admission.Wait.Duration before the handler started).
	Decided time.Time
}

type turnKey struct{}

// WithTurn returns ctx carrying the turn its request is sent on, for a
// paced Transport (Options.Paced). Limiter.Admit books the departure of
// a request it lets run on a turn at the subject's learned upstream rate
// in the same call, at the turn (throttle.Upstream): sent within an
// eighth of the learned interval of it (at least
// throttle.DepartureTolerance), the request leaves with no departure of
// its own (after throttle.Upstream.Leave, which reads the subject's pause
// and holds it an interval after the latest request that left); later,
// it departs on the upstream schedule as any request does.
func WithTurn(ctx context.Context, t Turn) context.Context {
	return context.WithValue(ctx, turnKey{}, t)
}

// turnDecidedMargin is how long after this process learned a subject's
// rate a turn must have been decided to count as one Admit decided at
// that rate (and so as the request's departure): more than a round trip
// to Redis and the time from a decision to its handler.
const turnDecidedMargin = 50 * time.Millisecond

// mayLeaveNow reports whether onTurn (at ref) or now would return a
// departure for a request of subject sent on turn, without taking it.
func (p *pacedSubjects) mayLeaveNow(subject string, turn Turn, ref time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.seen[subject]
	return ok && (p.onTurnOK(s, turn, ref) || p.nowOK(s))
}

// turnLate is how late for its turn a request may leave on it, when the
// subject's upstream taught the rate l: an eighth of its interval, at
// least throttle.DepartureTolerance. Such a request holds the next back
// by its lateness (throttle.Upstream.Leave), so what bounds it is only
// how far the turns behind it are pushed; a tighter bound left the turns
// of handlers that start 2-6ms late on a busy machine as holes (their
// requests departed on the schedule, an interval or more later).
func turnLate(l throttle.Learned) time.Duration {
	if l.Rate <= 0 {
		return throttle.DepartureTolerance(0)
	}
	iv := time.Duration(float64(time.Second) / l.Rate)
	return max(throttle.DepartureTolerance(iv), iv/8)
}

// onTurn returns a departure that leaves at once for a request sent on
// turn (zero: none) of a subject whose upstream taught a rate: if the
// turn was decided after this process learned the rate (so Admit booked
// it as the request's departure), what this process knows is recent
// enough to trust, and the request came within turnLate of its turn, at
// ref (before the call that says it leaves: that call does not make it
// late). Else false: the request departs on the schedule.
func (p *pacedSubjects) onTurn(subject string, turn Turn, ref time.Time) (*throttle.Departure, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.seen[subject]
	if !ok || !p.onTurnOK(s, turn, ref) {
		return nil, false
	}
	s.at = time.Now()
	p.seen[subject] = s
	return throttle.DepartNow(s.learned), true
}

// onTurnOK is onTurn's condition on what is known of the subject, s.
func (p *pacedSubjects) onTurnOK(s pacedSubject, turn Turn, ref time.Time) bool {
	l := s.learned
	if turn.At.IsZero() || l.Rate <= 0 || !turn.Decided.After(s.since.Add(turnDecidedMargin)) || ref.Sub(s.at) > throttle.UpstreamTTL/2 {
		return false
	}
	return ref.Sub(turn.At) <= turnLate(l)
}
