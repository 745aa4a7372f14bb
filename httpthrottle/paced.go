package httpthrottle

import (
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// PacedRecheck is how often a paced Transport (Options.Paced) books a
// departure for a subject it keeps sending to: that departure reads what
// the fleet learned meanwhile and keeps the subject's upstream state from
// expiring (throttle.UpstreamTTL).
const PacedRecheck = 30 * time.Second

// DefaultPacedHorizon is Options.PacedHorizon's default: admission's
// default horizon.
const DefaultPacedHorizon = time.Second

// pacedSubjects are the subjects a paced Transport has departed for
// lately, with what it last knew of each one's upstream.
type pacedSubjects struct {
	horizon time.Duration

	mu   sync.Mutex
	seen map[string]pacedSubject
}

type pacedSubject struct {
	at      time.Time // the last departure booked
	learned throttle.Learned
}

// now returns a departure that leaves at once for a subject departed for
// within PacedRecheck, and false for any other.
func (p *pacedSubjects) now(subject string) (*throttle.Departure, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.seen[subject]
	if !ok || time.Since(s.at) > PacedRecheck {
		return nil, false
	}
	return throttle.DepartNow(s.learned), true
}

// saw records a departure booked for subject and what it carried.
func (p *pacedSubjects) saw(subject string, l throttle.Learned) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.seen[subject]; !ok && len(p.seen) >= maxPacedSubjects {
		clear(p.seen) // many subjects: each departs once more
	}
	p.seen[subject] = pacedSubject{at: time.Now(), learned: l}
}

// learned records what is known of a subject's upstream after an answer.
func (p *pacedSubjects) learned(subject string, l throttle.Learned) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s, ok := p.seen[subject]; ok {
		s.learned = l
		p.seen[subject] = s
	}
}

// maxPacedSubjects bounds the memory of a paced Transport.
const maxPacedSubjects = 10000
