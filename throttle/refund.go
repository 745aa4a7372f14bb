package throttle

import (
	"context"
	"sync"
)

// A refunder holds the refunds of a limiter waiting for a call, by
// escaped subject (undos apart: see refund).
type refunder struct {
	mu        sync.Mutex
	bySubject map[string]*refundBatch
}

// refund gives back the permits of a reservation. Refunds of one subject
// are sent together: one goroutine per subject makes the calls, each with
// every refund that arrived while the previous call was out (up to
// maxRefundBatch), so a storm of cancellations (a shutdown, a batch timing
// out) costs a few round trips instead of one each, and does not queue for
// the client's connections until the refunds time out. It returns when its
// refund is made, or when ctx ends; the refund is then still made if Redis
// answers. undo (rolling back the part of one subject when another's
// rules refuse: subjects.go) gives the permits back even
// after their time to act, which a Cancel does not (bucket.lua). r holds
// the reservation: its permits, tickets and share ticket, and the Redis
// time (µs) of the call that made it: a rule reset since gives nothing
// back (lua/reset.lua).
func (l *Limiter) refund(ctx context.Context, subject string, r refundEntry, undo bool) error {
	if _, _, err := l.requestCosts(opRefund, subject, r.n, r.per, unbounded, r.tickets); err != nil {
		return err // bad input fails before it is queued
	}
	e := &refundEntry{ctx: ctx, n: r.n, per: r.per, booked: r.booked, tickets: r.tickets, share: r.share, done: make(chan struct{})}
	// Cancels and undos of one subject go in separate batches (one op per
	// call). An escaped subject holds no NUL, so the undo key, with a NUL
	// in front, is never another subject's.
	batchKey := escape(subject)
	if undo {
		batchKey = "\x00" + batchKey
	}
	rf := &l.refunds
	rf.mu.Lock()
	if rf.bySubject == nil {
		rf.bySubject = map[string]*refundBatch{}
	}
	b, flushing := rf.bySubject[batchKey]
	if !flushing {
		b = &refundBatch{undo: undo}
		rf.bySubject[batchKey] = b
	}
	b.pending = append(b.pending, e)
	rf.mu.Unlock()
	if !flushing {
		l.bg.run(func() { l.flushRefunds(batchKey, subject, b) })
	}
	select {
	case <-e.done:
		return e.err
	case <-ctx.Done():
		return &redisError{op: opRefund, err: ctx.Err()}
	}
}

// maxRefundBatch bounds the reservations one refund call gives back, and
// so how long that script holds Redis.
const maxRefundBatch = 256

// refundBatch holds the refunds of one subject waiting for a call.
type refundBatch struct {
	pending []*refundEntry
	undo    bool // op 'undo' rather than 'refund'
}

// refundEntry is one reservation to give back.
type refundEntry struct {
	ctx     context.Context // its caller's, for values; the call has its own deadline
	n       int
	per     Costs // its permits under each rule, if they differ (Reservation.per)
	booked  int64 // Redis time (µs) of the call that made it
	tickets []string
	share   string        // its share ticket (lua/refund.lua), "" for none
	done    chan struct{} // closed once err is set
	err     error
}

// flushRefunds sends subject's pending refunds until there are none left;
// batchKey is b's key in l.refunds.
func (l *Limiter) flushRefunds(batchKey, subject string, b *refundBatch) {
	rf := &l.refunds
	for {
		rf.mu.Lock()
		batch := b.pending[:min(len(b.pending), maxRefundBatch)]
		b.pending = b.pending[len(batch):]
		if len(batch) == 0 {
			delete(rf.bySubject, batchKey)
			rf.mu.Unlock()
			return
		}
		rf.mu.Unlock()
		err := l.refundNow(subject, batch, b.undo)
		for _, e := range batch {
			e.err = err
			close(e.done)
		}
	}
}

// refundNow gives back every reservation of batch in one script call,
// bounded by refundTimeout.
func (l *Limiter) refundNow(subject string, batch []*refundEntry, undo bool) error {
	call := refundArgs{subject: subject, undo: undo, batch: batch}
	o := call.op()
	keys, args, err := call.build(&l.policy)
	if err != nil {
		return err
	}
	ctx, cancel := ownTimeout(context.WithoutCancel(batch[0].ctx), refundTimeout)
	defer cancel()
	_, err = l.exec(ctx, o, l.scripts.of(o), keys, args)
	if err != nil {
		// A cancelled Wait drops this error (it returns ctx.Err()), so the
		// hook is where a refund lost to Redis shows: once per refund
		// (exec reported the first).
		for range batch[1:] {
			l.report(ctx, err.(*redisError).err, false)
		}
	}
	return err
}

// givebackKeys returns the keys a refund or settle of subject has after
// its rules' (lua/refund.lua): the pause key, so that the script can hold
// a running pause (pause.go); each rule's record named by suffix
// (cancelledSuffix, settledSuffix); and each rule's record of its latest
// Reset, so that a reservation made before it gives nothing back into the
// new state (state.go).
// settledKeys are subject's records of give-backs, one per rule
// (settledSuffix, bucket_rare.lua: bk_settle), as settle.lua declares
// them after the pause key.
func (p *policy) settledKeys(subject string) []string {
	return p.givebackKeys(subject, settledSuffix)[1 : 1+len(p.keyRules)]
}

func (p *policy) givebackKeys(subject, suffix string) []string {
	enc := escape(subject)
	keys := make([]string, 0, 2*len(p.keyRules)+1)
	keys = append(keys, p.pauseKey(subject))
	for _, r := range p.keyRules {
		keys = append(keys, key(p.prefix, enc, r+suffix))
	}
	for _, r := range p.keyRules {
		keys = append(keys, key(p.prefix, enc, r+resetSuffix))
	}
	return keys
}
