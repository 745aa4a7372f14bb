package throttle

import "cmp"

// CheckN reports, without calling Redis, the error that any request of n
// permits for subject fails with at once, whatever the state: a negative
// n, an error matching ErrInvalidSubject (an empty or too long subject),
// or one matching ErrExceedsCapacity (more than a rule can ever admit at
// once). nil means that Redis decides. A producer that books many
// requests ahead (a batch) checks them all first, so that it books none
// of a batch that would fail part way.
func (l *Limiter) CheckN(subject string, n int) error {
	for _, p := range l.mode.parts() {
		if _, err := p.lim.check(p.of(subject), n); err != nil {
			return err
		}
	}
	return nil
}

// CheckCosts is CheckN for a request with a cost per rule (see Costs): the
// error it fails with at once, without calling Redis, whatever the state;
// nil means that Redis decides.
func (l *Limiter) CheckCosts(subject string, c Costs) error {
	n, per, err := l.costs(c)
	if err != nil || per == nil {
		return cmp.Or(err, l.CheckN(subject, n))
	}
	_, err = encodeSubject(subject)
	return err
}

// Capacity is the most permits r admits at one instant, and so the
// largest request it can ever admit: Burst for TokenBucket and GCRA,
// Count for the windows. A Concurrency rule's holder takes one place
// whatever its n: its capacity is MaxPermits.
func (r Rule) Capacity() int { return r.Limit.capacity(r.Algorithm) }
