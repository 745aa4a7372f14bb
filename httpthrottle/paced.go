package httpthrottle

import (
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
}

// now returns a departure that leaves at once for a subject whose
// upstream taught no rate (as far as this process knows, from an answer
// within PacedRecheck), and false for any other: its request departs on
// the upstream schedule.
func (p *pacedSubjects) now(subject string) (*throttle.Departure, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.seen[subject]
	if !ok || s.learned.Rate > 0 || time.Since(s.at) > PacedRecheck {
		return nil, false
	}
	return throttle.DepartNow(s.learned), true
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
	p.seen[subject] = pacedSubject{at: time.Now(), learned: l}
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
