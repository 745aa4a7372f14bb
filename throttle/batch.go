package throttle

import (
	"context"
	"slices"
	"sync"
	"time"
)

// Concurrent AllowN calls of one Limiter are sent together. Each call is
// one EVALSHA either way; what batching saves is the write and the read
// per call, on the client and on the server, which is most of what an
// Allow costs (BENCHMARKS.md, Allow throughput).
//
// Batching is opportunistic and adds no wait: a call that finds nothing
// queued and fewer than maxBatchSenders sends out goes at once, alone, on
// its own context, exactly as without batching; other calls queue, and a
// sender takes everything queued as one batch as soon as one is free.
// Only AllowN calls are batched: Reserve and Wait book slots whose order
// and timing the waits depend on, and window waits already send one call
// per process head.
type allowBatcher struct {
	mu      sync.Mutex
	pending []*batchedCall
	senders int // batches out, at most maxBatchSenders
}

const (
	// maxBatchSenders bounds the batches in flight per Limiter. With one,
	// callers sit idle for a whole round trip while a batch is out; the
	// prototype measured 2 and 4 close together, 8 slower (more, smaller
	// batches), on 50 goroutines sharing 2 cores with Redis.
	maxBatchSenders = 4
	// maxBatch bounds the calls in one pipeline, and so how long one
	// batch holds a connection.
	maxBatch = 256
)

// batchedCall is one queued AllowN.
type batchedCall struct {
	ctx   context.Context
	line  []any // its script call (run.go)
	reply any
	err   error
	done  chan struct{} // closed once reply and err are set
}

// runAllow runs one allow decision, the script call line (run.go),
// batched with concurrent ones unless Options.NoBatching. Every caller
// returns when its answer is in or its context ends, whichever comes
// first.
func (l *Limiter) runAllow(ctx context.Context, line []any) (any, error) {
	if l.opts.NoBatching {
		return l.run(ctx, l.scripts.allow, line).Result()
	}
	b := &l.batch
	b.mu.Lock()
	if b.senders < maxBatchSenders && len(b.pending) == 0 {
		// Nothing queued and a sender free: go alone, as without
		// batching, then hand calls queued meanwhile to a sender.
		b.senders++
		b.mu.Unlock()
		reply, err := l.run(ctx, l.scripts.allow, line).Result()
		b.mu.Lock()
		if len(b.pending) == 0 {
			b.senders--
			b.mu.Unlock()
		} else {
			b.mu.Unlock()
			l.bg.run(l.drain) // keeps the place this call held
		}
		return reply, err
	}
	c := &batchedCall{ctx: ctx, line: line, done: make(chan struct{})}
	b.pending = append(b.pending, c)
	start := b.senders < maxBatchSenders
	if start {
		b.senders++
	}
	b.mu.Unlock()
	if start {
		l.bg.run(l.drain)
	}
	select {
	case <-c.done:
		return c.reply, c.err
	case <-ctx.Done():
		// Still queued, it will be dropped unsent (sendBatch checks);
		// already sent, its answer is lost, as a call cut short by its
		// context is without batching.
		return nil, ctx.Err()
	}
}

// drain holds a sender's place: it sends batches of what is queued until
// nothing is, and gives the place back.
func (l *Limiter) drain() {
	b := &l.batch
	var calls []*batchedCall
	for {
		if len(calls) > 0 {
			l.sendBatch(calls)
		}
		b.mu.Lock()
		n := min(len(b.pending), maxBatch)
		if n == 0 {
			b.senders--
			b.mu.Unlock()
			return
		}
		calls = slices.Clone(b.pending[:n])
		b.pending = slices.Delete(b.pending, 0, n)
		b.mu.Unlock()
	}
}

// sendBatch sends calls as one pipeline of EVALSHAs (one alone goes out on
// its own, on its caller's context) and hands each its answer. Calls whose
// context ended while queued are dropped unsent.
func (l *Limiter) sendBatch(calls []*batchedCall) {
	live := calls[:0]
	for _, c := range calls {
		if err := c.ctx.Err(); err != nil {
			c.finish(nil, err)
			continue
		}
		live = append(live, c)
	}
	switch len(live) {
	case 0:
		return
	case 1:
		c := live[0]
		c.finish(l.run(c.ctx, l.scripts.allow, c.line).Result())
		return
	}
	ctx, cancel := batchContext(live)
	defer cancel()
	for i, cmd := range l.runPipelined(ctx, l.scripts.allow, live) {
		live[i].finish(cmd.Result())
	}
}

// batchContext is the context of a batch: it serves several callers, so
// none of them may cancel it, but it ends at the latest of their deadlines
// (if they all have one), when none of them waits any longer.
func batchContext(calls []*batchedCall) (context.Context, context.CancelFunc) {
	ctx := context.WithoutCancel(calls[0].ctx)
	var latest time.Time
	for _, c := range calls {
		d, ok := c.ctx.Deadline()
		if !ok {
			return ctx, func() {}
		}
		if d.After(latest) {
			latest = d
		}
	}
	return context.WithDeadline(ctx, latest)
}

// finish sets a call's answer and wakes its caller if it is queued.
func (c *batchedCall) finish(reply any, err error) {
	c.reply, c.err = reply, err
	if c.done != nil {
		close(c.done)
	}
}
