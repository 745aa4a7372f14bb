package throttle

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Concurrency: lua/concurrency.lua keeps, per subject, one sorted set of
// the holders of a place (scored by their lease's expiry) and of the
// waiters for one (by arrival). admit.lua takes a place or queues
// for one; lua/lease.lua renews and releases. A Limiter with a Concurrency
// rule keeps the places its process holds (leases, below) and renews them
// while they are held.
var _ = register(Concurrency, &algorithm{rank: 6, files: []string{"concurrency.lua"}, holders: true, validate: validateConcurrency})

// leaseScript renews and releases places (lua/lease.lua).
var leaseScript = buildScript("prelude.lua", "concurrency.lua", "lease.lua")

// validateConcurrency checks a Concurrency rule: Limit.Count places, each
// leased for Limit.Period, which must leave time to renew.
func validateConcurrency(r Rule) error {
	if r.Limit.Period < minLease {
		return &ConfigError{Rule: r.Name, Field: "lease", Reason: fmt.Sprintf("%v must be at least %v (Limit.Period is the lease of a concurrency rule)", r.Limit.Period, minLease)}
	}
	return nil
}

// minLease is the shortest lease: a holder renews three times per lease,
// and each renewal is a round trip.
const minLease = 100 * time.Millisecond

// leases are the places of a limiter's Concurrency rule that this process
// holds, which it renews every third of the lease until they are released,
// and the callers waiting in Wait for one.
type leases struct {
	exact // what the places do not decide: ReserveN
	lim   *Limiter
	rule  int // the Concurrency rule's index
	count int
	lease time.Duration

	mu      sync.Mutex
	held    map[string][]string      // subject -> ids holding a place
	waiting map[string]chan struct{} // ids of Wait callers -> woken when handed a place
	idle    chan struct{}            // closed when no place is held: the renewal goroutine, if any, ends
}

// newLeases returns the leases of a Concurrency rule of ex's limiter; nil
// without one, an error if it has two.
func newLeases(ex exact) (*leases, error) {
	l := ex.l
	var s *leases
	for i, r := range l.rules {
		if r.Algorithm != Concurrency {
			continue
		}
		if s != nil {
			return nil, &ConfigError{Rule: r.Name, Field: "algorithm", Reason: fmt.Sprintf("a limiter has at most one concurrency rule, and %q is one", l.rules[s.rule].Name)}
		}
		s = &leases{exact: ex, lim: l, rule: i, count: r.Limit.Count, lease: r.Limit.Period,
			held: map[string][]string{}, waiting: map[string]chan struct{}{}}
	}
	return s, nil
}

func (s *leases) allow(context.Context, string, int) (Result, error) {
	return Result{}, s.only("AllowN")
}

// admit is Admit under a Concurrency rule: a place granted is held (and
// renewed) from now on, and the waiters the call handed places to are
// woken.
func (s *leases) admit(ctx context.Context, req AdmitRequest) (Admission, error) {
	a, did, err := s.lim.admitOne(ctx, req)
	if err != nil || did.rep.raw == nil { // failed, or granted without Redis
		return a, err
	}
	woken := s.woken(did.rep.raw, len(s.lim.rules))
	if req.N > 0 && (a.Status == Granted || a.Status == Redeemed) {
		a.Place = s.hold(req.Subject, did.who.waitAs)
		a.Lease = s.lease
	}
	if did.rep.status == admitQueued {
		a.Lease = s.lease
	}
	s.deliver(woken)
	return a, nil
}

func (s *leases) close() {}

// only is the error of an operation that a limiter with a Concurrency
// rule does not offer.
// It is a *ConfigError naming the rule, field "algorithm", returned before
// any call to Redis: httpthrottle.New tells a concurrency limiter by it.
func (s *leases) only(op string) error {
	return &ConfigError{Rule: s.lim.rules[s.rule].Name, Field: "algorithm", Reason: op + " does not apply to a concurrency limit; take a place with Wait or Admit and give it back with Release"}
}

// woken returns the ids that an admit reply says were handed a place: its
// last value, when the reply has one; nil otherwise.
func (s *leases) woken(reply []any, nrules int) []any {
	if len(reply) != 7+nrules {
		return nil
	}
	w, ok := reply[len(reply)-1].([]any)
	if !ok {
		return nil
	}
	return w
}

// hold records a place id holds for subject, and renews it from now on.
func (s *leases) hold(subject, id string) *Place {
	p := &Place{s: s, subject: subject, id: id}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range s.held[subject] {
		if h == id {
			return p
		}
	}
	s.held[subject] = append(s.held[subject], id)
	if s.idle == nil {
		idle := make(chan struct{})
		if s.lim.bg.start(func() { s.renew(idle) }) { // not after Close
			s.idle = idle
		}
	}
	return p
}

// deliver wakes the ids handed a place: a Wait of this process directly,
// the others through Options.OnHandoff.
func (s *leases) deliver(woken []any) {
	var others []string
	s.mu.Lock()
	for _, v := range woken {
		id, _ := v.(string)
		if ch, ok := s.waiting[id]; ok {
			select {
			case ch <- struct{}{}:
			default:
			}
		} else if id != "" {
			others = append(others, id)
		}
	}
	s.mu.Unlock()
	if len(others) > 0 && s.lim.opts.OnHandoff != nil {
		s.lim.opts.OnHandoff(others)
	}
}

// renewTimeout bounds one renewal or release call.
const renewTimeout = 5 * time.Second

// renew renews every held place once per third of the lease, one call per
// subject, until none is held or the limiter is closed. A place found lost
// (this process stalled past its lease, and the place was handed on) is
// dropped and logged: its holder runs on without it.
func (s *leases) renew(idle chan struct{}) {
	ctx := s.lim.bg.context()
	t := time.NewTicker(s.lease / 3)
	defer t.Stop()
	for {
		select {
		case <-idle:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.mu.Lock()
		held := make(map[string][]string, len(s.held))
		for subj, ids := range s.held {
			held[subj] = append([]string(nil), ids...)
		}
		s.mu.Unlock()
		for subj, ids := range held {
			woken, lost, err := s.call(ctx, opRenew, subj, ids)
			if err != nil {
				s.lim.opts.Logger.Warn("throttle: cannot renew concurrency leases; they expire unless a later renewal gets through", "rule", s.lim.rules[s.rule].Name, "subject", subj, "error", err)
				continue
			}
			for _, id := range lost {
				s.drop(subj, id)
				s.lim.opts.Logger.Warn("throttle: a concurrency lease expired while its holder ran (the process stalled past the lease); its place went to another", "rule", s.lim.rules[s.rule].Name, "subject", subj, "holder", id)
			}
			s.deliver(woken)
		}
	}
}

// takeLast forgets one of the places held for subject, the latest taken
// (the places a process holds for a subject are alike), and returns its id.
func (s *leases) takeLast(subject string) (string, bool) {
	s.mu.Lock()
	ids := s.held[subject]
	if len(ids) == 0 {
		s.mu.Unlock()
		return "", false
	}
	id := ids[len(ids)-1]
	s.mu.Unlock()
	// drop takes the lock again; another takeLast between the two may
	// have taken id: then take the next.
	if !s.drop(subject, id) {
		return s.takeLast(subject)
	}
	return id, true
}

// drop forgets a place id held for subject; it reports whether it was held.
func (s *leases) drop(subject, id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := s.held[subject]
	for i, h := range ids {
		if h == id {
			ids = append(ids[:i], ids[i+1:]...)
			if len(ids) == 0 {
				delete(s.held, subject)
				if len(s.held) == 0 && s.idle != nil {
					close(s.idle)
					s.idle = nil
				}
			} else {
				s.held[subject] = ids
			}
			return true
		}
	}
	return false
}

// call runs lease.lua's o (opRenew or opRelease) for ids, within ctx and
// at most renewTimeout.
func (s *leases) call(ctx context.Context, o op, subject string, ids []string) (woken []any, lost []string, err error) {
	enc, err := encodeSubject(subject)
	if err != nil {
		return nil, nil, err
	}
	l := s.lim
	args := make([]any, 0, 3+len(ids))
	args = append(args, string(o), s.count, s.lease.Microseconds())
	for _, id := range ids {
		args = append(args, id)
	}
	ctx, cancel := ownTimeout(ctx, renewTimeout)
	defer cancel()
	cmd, err := l.exec(ctx, o, leaseScript, []string{key(l.prefix, enc, l.keyRules[s.rule])}, args)
	if err != nil {
		return nil, nil, err
	}
	reply, err := cmd.Slice()
	if err != nil {
		return nil, nil, err
	}
	if len(reply) != 2 {
		return nil, nil, badReply(reply)
	}
	woken, _ = reply[0].([]any)
	lostv, _ := reply[1].([]any)
	for _, v := range lostv {
		id, _ := v.(string)
		lost = append(lost, id)
	}
	return woken, lost, nil
}

// A Place is one of the Count places of a Concurrency rule, held by the
// caller that took it (Acquire, or Admit: Admission.Place) while its work
// runs, and renewed by the limiter in the background until Release. A nil
// *Place holds nothing; its Release does nothing.
type Place struct {
	s        *leases
	subject  string
	id       string // its holder's id in Redis
	released atomic.Bool
}

// Release gives the place back and hands it to the subject's next waiter.
// Call it when the work ends, whether it succeeded or not; ctx bounds the
// call (context.WithoutCancel of the work's context gives it back even if
// the work was cancelled). A place not released (the process died, or
// Redis failed) frees when its lease expires. It works after the
// limiter's Close. It returns an error if the place was released already
// or lost (this process stalled past its lease and the place went to
// another), and one matching ErrRedis if Redis fails or ctx ends first.
func (p *Place) Release(ctx context.Context) error {
	if p == nil {
		return nil
	}
	if p.released.Swap(true) {
		return errors.New("throttle: release: the place was released already")
	}
	s := p.s
	if !s.drop(p.subject, p.id) {
		return fmt.Errorf("throttle: release: this process no longer holds its place of rule %q for subject %q: it was lost when its lease expired, or given back by Limiter.Release", s.lim.rules[s.rule].Name, p.subject)
	}
	return s.release(ctx, p.subject, p.id)
}

// Release gives back a place of the limiter's Concurrency rule that this
// process holds for subject (taken by Wait, or by an Admit that was Granted
// or Redeemed), the latest it took, and hands it to the subject's next
// waiter. It returns an error if the limiter has no Concurrency rule or
// this process holds no place for subject, and an error matching ErrRedis
// if Redis fails or ctx ends first (the place then frees when its lease
// expires).
//
// Deprecated: Release gives back whichever place of subject this process
// took last, which need not be the caller's. Hold the place itself: take
// it with Acquire (or find it in Admission.Place) and give it back with
// Place.Release.
func (l *Limiter) Release(ctx context.Context, subject string) error {
	s, ok := l.mode.(*leases)
	if !ok {
		return errors.New("throttle: release: the limiter has no concurrency rule")
	}
	id, ok := s.takeLast(subject)
	if !ok {
		return fmt.Errorf("throttle: release: this process holds no place of rule %q for subject %q", l.rules[s.rule].Name, subject)
	}
	return s.release(ctx, subject, id)
}

// release gives back id's place of subject in Redis, no longer held here,
// and wakes whoever it was handed to.
func (s *leases) release(ctx context.Context, subject, id string) error {
	woken, _, err := s.call(ctx, opRelease, subject, []string{id})
	if err != nil {
		return err
	}
	s.deliver(woken)
	return nil
}

// waitTolerance is how late a Wait caller may come back for its booked
// turn: it comes back on its own timer, at once.
const waitTolerance = time.Second

// wait is WaitN for a limiter with a Concurrency rule: it takes a place,
// queueing for one first if they are all taken (woken when one is handed
// to it: at once by a release in this process, else at its fallback; see
// Admission.At), and a turn of the policy's rate rules. It fails at once
// with a *DelayError if the turn of a rate rule is past the context's
// deadline or MaxWait. If the context ends, its place (or its position in
// the queue) is given up and ctx.Err() returned.
func (s *leases) wait(ctx context.Context, subject string, n int) (*Place, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // nothing taken, nothing to give up
	}
	l := s.lim
	id := "wait:" + newReceiptID()
	woken := make(chan struct{}, 1)
	s.mu.Lock()
	s.waiting[id] = woken
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.waiting, id)
		s.mu.Unlock()
	}()
	// giveUp leaves the queue or gives back a place the caller was handed.
	giveUp := func(err error) error {
		s.drop(subject, id)
		if woken, _, rerr := s.call(context.WithoutCancel(ctx), opRelease, subject, []string{id}); rerr == nil {
			s.deliver(woken)
		}
		return err
	}
	for {
		if err := ctx.Err(); err != nil {
			return nil, giveUp(err)
		}
		a, err := l.Admit(ctx, AdmitRequest{Subject: subject, N: n, Caller: Caller{ID: id}, Wait: -1, Tolerance: waitTolerance})
		if err != nil {
			return nil, giveUp(err)
		}
		switch a.Status {
		case Granted, Redeemed:
			bound, byDeadline := l.waitBound(ctx, time.Now())
			if bound >= 0 && a.Delay > bound {
				if a.Reservation != nil {
					_ = a.Reservation.Cancel(context.WithoutCancel(ctx))
				}
				return nil, giveUp(&DelayError{Rule: a.Rule, RetryAfter: a.Delay, Deadline: byDeadline})
			}
			if err := sleep(ctx, time.Until(a.At)); err != nil {
				if a.Reservation != nil {
					_ = a.Reservation.Cancel(context.WithoutCancel(ctx))
				}
				return nil, giveUp(err)
			}
			return a.Place, nil
		case Booked, Held:
			// Queued for a place (or, for a turn booked earlier, held):
			// back when handed one, or at the fallback.
			t := time.NewTimer(time.Until(a.At))
			select {
			case <-woken:
			case <-t.C:
			case <-ctx.Done():
			case <-l.bg.context().Done(): // Close: Admit says so
			}
			t.Stop()
		default:
			return nil, giveUp(&DelayError{Rule: a.Rule, RetryAfter: a.Delay})
		}
	}
}
