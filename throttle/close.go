package throttle

import (
	"context"
	"errors"
	"sync"
)

// ErrClosed is returned by a Limiter's calls after Close.
var ErrClosed = errors.New("throttle: the limiter is closed: build another with New")

// Close stops the limiter's goroutines and timers: the renewal of the
// places of a Concurrency rule, the sends of batched Allow calls and of
// refunds, and the runs of turns of Options.LocalLease, whose unused turns
// it gives back to Redis first. It returns once they have ended. After
// Close, AllowN, ReserveN, WaitN, Admit, ServeLine, PrepayN, AllowAtMost,
// PauseFor and Reset return ErrClosed; a Wait in progress for a place
// returns it too. A place still held is no longer renewed: give it back
// before Close (Place.Release, which still works after it), or it frees
// when its lease expires. Reservation.Cancel and Settle still work.
// Calling Close again does nothing. It returns nil; the error is for
// io.Closer.
func (l *Limiter) Close() error {
	if l.closed.Swap(true) {
		return nil
	}
	l.mode.close()
	l.bg.close()
	return nil
}

// open returns ErrClosed once the limiter is closed.
func (l *Limiter) open() error {
	if l.closed.Load() {
		return ErrClosed
	}
	return nil
}

// goroutines are a limiter's own goroutines, which Close ends and waits
// for. Their context ends with Close.
type goroutines struct {
	once   sync.Once
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.RWMutex
	closed bool
	wg     sync.WaitGroup
}

// context returns the context that Close ends.
func (g *goroutines) context() context.Context {
	g.once.Do(func() { g.ctx, g.cancel = context.WithCancel(context.Background()) })
	return g.ctx
}

// start runs f in a goroutine that Close waits for, and reports whether it
// did: after Close it does not.
func (g *goroutines) start(f func()) bool {
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.closed {
		return false
	}
	g.wg.Go(f)
	return true
}

// run runs f in a goroutine that Close waits for; after Close, here.
func (g *goroutines) run(f func()) {
	if !g.start(f) {
		f()
	}
}

// close ends the goroutines' context and waits for them.
func (g *goroutines) close() {
	g.context()
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.cancel()
	g.wg.Wait()
}
