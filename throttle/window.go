package throttle

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"
)

// windowQueues holds a window limiter's local queues of waiters, by
// encoded subject.
type windowQueues struct {
	mu        sync.Mutex
	bySubject map[string]*waitQueue
}

// waitQueue lines up this process's waiters on one subject of a window
// limiter. Only the head asks Redis; the others wait for it to leave, so
// Redis sees about one call per admitted request plus one per refill.
type waitQueue struct {
	waiters []*waiter // waiters[0] is the head; its turn is closed
	// until is when the head was last told a permit frees, and rule the
	// rule that said so. changed is closed, and replaced, whenever they
	// move, so that a waiter whose bound ends before until fails at once
	// (a wait that cannot end in time fails at once) instead of queueing
	// in vain.
	until   time.Time
	rule    string
	changed chan struct{}
}

// waiter is one Wait in a waitQueue.
type waiter struct {
	turn chan struct{} // closed when the waiter becomes the head
	// failed, if set (under windowQueues.mu, before turn closes), is the Redis
	// error that a waiter ahead got while this one queued. The waiter
	// takes that answer instead of asking the same dead Redis again: one
	// failing call per outage, not one per queued waiter in turn (which,
	// with go-redis's retries, took 30s for 200 waiters).
	failed error
}

// waitWindow waits its turn in the local queue, then asks Redis at the
// times the script names until it is admitted, the bound passes, or ctx
// ends.
func (l *Limiter) waitWindow(ctx context.Context, subject string, n int) (*Reservation, error) {
	start := time.Now()
	if _, _, err := l.request(opAllow, subject, n, unbounded, nil); err != nil {
		return nil, err // bad input fails before queueing
	}
	w := l.queues.enqueue(subject)
	defer l.queues.leave(subject, w)

	if err := l.awaitTurn(ctx, subject, w, start); err != nil {
		return nil, err
	}
	l.queues.mu.Lock()
	failed := w.failed
	l.queues.mu.Unlock()
	if failed != nil {
		return l.failOpenOr(ctx, opAllow, subject, n, failed)
	}
	for {
		res, r, err := l.ask(ctx, opAllow, subject, n, unbounded, true, nil)
		if re, ok := err.(*redisError); ok {
			if ctx.Err() == nil && !errors.Is(re.err, context.DeadlineExceeded) { // not this waiter's own deadline: Redis failed
				l.queues.shareFailure(subject, re.err)
			}
			return l.failOpenOr(ctx, opAllow, subject, n, re.err)
		}
		if err != nil {
			return nil, err
		}
		if res.Allowed {
			return r, nil
		}
		now := time.Now()
		l.queues.announce(subject, now.Add(res.RetryAfter), res.Rule)
		if bound, byDeadline := l.waitBound(ctx, start); bound >= 0 && now.Add(res.RetryAfter).After(start.Add(bound)) {
			return nil, &DelayError{Rule: res.Rule, RetryAfter: res.RetryAfter, Deadline: byDeadline}
		}
		if err := sleep(ctx, res.RetryAfter); err != nil {
			return nil, err
		}
	}
}

// awaitTurn blocks until w is the head of subject's queue. It fails when
// ctx ends, or, with a *DelayError, as soon as the head learns that no
// permit frees before this waiter's bound (the context's deadline or
// MaxWait, counted from start), or when MaxWait passes.
func (l *Limiter) awaitTurn(ctx context.Context, subject string, w *waiter, start time.Time) error {
	var expired <-chan time.Time
	if l.opts.MaxWait > 0 {
		t := time.NewTimer(time.Until(start.Add(l.opts.MaxWait)))
		defer t.Stop()
		expired = t.C
	}
	bound, byDeadline := l.waitBound(ctx, start)
	for {
		until, rule, changed := l.queues.state(subject)
		now := time.Now()
		if bound >= 0 && until.After(start.Add(bound)) {
			return &DelayError{Rule: rule, RetryAfter: until.Sub(now), Deadline: byDeadline}
		}
		select {
		case <-w.turn:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		case <-expired:
			// The permits freed so far went to waiters ahead; the next
			// comes no sooner than the head was told, or one interval.
			return &DelayError{Rule: l.rules[0].Name, RetryAfter: max(until.Sub(now), l.rules[0].Limit.interval())}
		}
	}
}

// state returns when the head of subject's queue was told a permit frees,
// the rule that said so, and the channel closed when that changes.
func (qs *windowQueues) state(subject string) (time.Time, string, chan struct{}) {
	qs.mu.Lock()
	defer qs.mu.Unlock()
	q := qs.bySubject[subject]
	return q.until, q.rule, q.changed
}

// announce records when the head of subject's queue was told a permit
// frees, and wakes the waiters behind it to check their bounds.
func (qs *windowQueues) announce(subject string, until time.Time, rule string) {
	qs.mu.Lock()
	defer qs.mu.Unlock()
	q := qs.bySubject[subject]
	q.until, q.rule = until, rule
	close(q.changed)
	q.changed = make(chan struct{})
}

// enqueue appends a waiter to subject's queue and returns it; its turn
// closes when it becomes the head.
func (qs *windowQueues) enqueue(subject string) *waiter {
	w := &waiter{turn: make(chan struct{})}
	qs.mu.Lock()
	defer qs.mu.Unlock()
	q := qs.bySubject[subject]
	if q == nil {
		if qs.bySubject == nil {
			qs.bySubject = map[string]*waitQueue{}
		}
		q = &waitQueue{changed: make(chan struct{})}
		qs.bySubject[subject] = q
	}
	q.waiters = append(q.waiters, w)
	if len(q.waiters) == 1 {
		close(w.turn)
	}
	return w
}

// shareFailure gives err, a Redis error the head of subject's queue got,
// to every waiter queued behind it.
func (qs *windowQueues) shareFailure(subject string, err error) {
	qs.mu.Lock()
	defer qs.mu.Unlock()
	for _, w := range qs.bySubject[subject].waiters[1:] {
		if w.failed == nil {
			w.failed = err
		}
	}
}

// leave removes a waiter from subject's queue, handing the turn on if it
// was the head.
func (qs *windowQueues) leave(subject string, w *waiter) {
	qs.mu.Lock()
	defer qs.mu.Unlock()
	q := qs.bySubject[subject]
	i := slices.Index(q.waiters, w)
	q.waiters = slices.Delete(q.waiters, i, i+1)
	switch {
	case len(q.waiters) == 0:
		delete(qs.bySubject, subject)
	case i == 0:
		close(q.waiters[0].turn)
	}
}

// sleep waits for d or until ctx ends, whose error it returns then.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
