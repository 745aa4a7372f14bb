package throttle

import (
	"context"
	"sync/atomic"
)

// A Limiter decides in one of four modes, chosen once by New from its
// rules and options, and its methods dispatch through it:
//
//   - exact: every decision is a script call (this file);
//   - severalSubjects: rules over several subjects, one Limiter per
//     subject acquired in order (subjects.go);
//   - *leases: a Concurrency rule's places, renewed while held
//     (concurrency.go);
//   - *leaser: runs of one hot bucket's turns handed out in this process,
//     Options.LocalLease (leased.go).
//
// The last two decide what they do not serve themselves as exact does.
type mode interface {
	// allow is AllowN's decision.
	allow(ctx context.Context, subject string, n int) (Result, error)
	// acquire books n permits without sleeping until their time to act:
	// a reservation (reserve, or a bucket policy), or a window's permits
	// once the local queue and Redis grant them.
	acquire(ctx context.Context, subject string, n int, reserve bool) (*Reservation, error)
	// wait is WaitN's; a place it takes comes back (nil without one).
	wait(ctx context.Context, subject string, n int) (*Place, error)
	// admit is Admit's, req's Tolerance filled in.
	admit(ctx context.Context, req AdmitRequest) (Admission, error)
	// parts are the limiters over one subject each that a request
	// charges: the limiter itself but in severalSubjects.
	parts() []part
	// forget drops what this process holds of subject's turns (a pause,
	// a reset).
	forget(subject string)
	// close stops the mode's goroutines and timers (Limiter.Close).
	close()
}

var (
	_ mode = exact{}
	_ mode = severalSubjects{}
	_ mode = (*leases)(nil)
	_ mode = (*leaser)(nil)
)

// chooseMode returns l's mode: its rules and options decide it, once.
func chooseMode(l *Limiter) (mode, error) {
	parts, err := splitParts(l)
	if err != nil {
		return nil, err
	}
	if parts != nil {
		if l.opts.LocalLease != 0 {
			return nil, &ConfigError{Field: "local_lease", Reason: "needs one rule over the caller's subject: rules over several subjects cannot lease"}
		}
		for _, r := range l.rules {
			if r.Algorithm == Concurrency {
				return nil, &ConfigError{Rule: r.Name, Field: "subject", Reason: "a concurrency rule needs every rule of its limiter over the caller's subject (no Rule.Subject): its places are decided in one call with the rate rules"}
			}
		}
		buckets := true
		for _, r := range l.rules {
			buckets = buckets && (r.Algorithm == GCRA || r.Algorithm == TokenBucket)
		}
		return severalSubjects{l: l, ps: parts, lead: new(atomic.Int32), buckets: buckets}, nil
	}
	l.scripts = scriptsFor(l.rules)
	ex := exact{l: l, self: []part{{lim: l}}}
	q, err := newLeaser(ex, l.opts)
	if err != nil || q != nil {
		return q, err
	}
	s, err := newLeases(ex)
	if err != nil || s != nil {
		return s, err
	}
	return ex, nil
}

// exact is the mode of a limiter over one subject whose every decision is
// a script call.
type exact struct {
	l    *Limiter
	self []part // the limiter itself, its one part
}

func (m exact) allow(ctx context.Context, subject string, n int) (Result, error) {
	res, _, err := m.l.decide(ctx, opAllow, subject, n, unbounded, false, nil)
	return res, err
}

func (m exact) acquire(ctx context.Context, subject string, n int, reserve bool) (*Reservation, error) {
	if reserve || m.l.buckets {
		return m.l.reserve(ctx, subject, n)
	}
	return m.l.waitWindow(ctx, subject, n)
}

func (m exact) wait(ctx context.Context, subject string, n int) (*Place, error) {
	return nil, m.l.acquireAndWait(ctx, subject, n)
}

func (m exact) admit(ctx context.Context, req AdmitRequest) (Admission, error) {
	a, _, err := m.l.admitOne(ctx, req)
	return a, err
}

func (m exact) parts() []part { return m.self }
func (m exact) forget(string) {}
func (m exact) close()        {}
