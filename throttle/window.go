package throttle

import (
	"context"
	"slices"
	"time"
)

// waitQueue lines up this process's waiters on one subject of a window
// limiter. Only the head asks Redis; the others wait for it to leave, so
// Redis sees about one call per admitted request plus one per refill.
type waitQueue struct {
	waiters []chan struct{} // waiters[0] is the head; its channel is closed
}

// waitWindow waits its turn in the local queue, then asks Redis at the
// times the script names until it is admitted, the bound passes, or ctx
// ends.
func (l *Limiter) waitWindow(ctx context.Context, subject string, n int) (*Reservation, error) {
	start := time.Now()
	if _, _, err := l.request("allow", subject, n, -1, nil); err != nil {
		return nil, err // bad input fails before queueing
	}
	turn := l.enqueue(subject)
	defer l.leave(subject, turn)

	if err := l.awaitTurn(ctx, turn, start); err != nil {
		return nil, err
	}
	for {
		res, r, err := l.decide(ctx, "allow", subject, n, -1)
		if err != nil {
			return nil, err
		}
		if res.Allowed {
			return r, nil
		}
		now := time.Now()
		if bound, byDeadline := l.waitBound(ctx, start); bound >= 0 && now.Add(res.RetryAfter).After(start.Add(bound)) {
			return nil, &DelayError{Rule: res.Rule, RetryAfter: res.RetryAfter, Deadline: byDeadline}
		}
		if err := sleep(ctx, res.RetryAfter); err != nil {
			return nil, err
		}
	}
}

// awaitTurn blocks until turn is the head of its queue, ctx ends, or
// MaxWait (counted from start) passes.
func (l *Limiter) awaitTurn(ctx context.Context, turn chan struct{}, start time.Time) error {
	var expired <-chan time.Time
	if l.opts.MaxWait > 0 {
		t := time.NewTimer(time.Until(start.Add(l.opts.MaxWait)))
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-turn:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-expired:
		return &DelayError{Rule: l.rules[0].Name, RetryAfter: l.opts.MaxWait}
	}
}

// enqueue appends a waiter to subject's queue and returns its channel,
// closed when it becomes the head.
func (l *Limiter) enqueue(subject string) chan struct{} {
	turn := make(chan struct{})
	l.mu.Lock()
	defer l.mu.Unlock()
	q := l.queues[subject]
	if q == nil {
		q = &waitQueue{}
		l.queues[subject] = q
	}
	q.waiters = append(q.waiters, turn)
	if len(q.waiters) == 1 {
		close(turn)
	}
	return turn
}

// leave removes a waiter from subject's queue, handing the turn on if it
// was the head.
func (l *Limiter) leave(subject string, turn chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	q := l.queues[subject]
	i := slices.Index(q.waiters, turn)
	q.waiters = slices.Delete(q.waiters, i, i+1)
	switch {
	case len(q.waiters) == 0:
		delete(l.queues, subject)
	case i == 0:
		close(q.waiters[0])
	}
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
