package main

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"syscall"
)

// errStoppedAtOnce ends a run that a second SIGINT or SIGTERM stopped
// before its graceful shutdown was over; the log has said so.
var errStoppedAtOnce = errors.New("stopped at once by a second signal")

// signalled is what the process's signals ask of a run.
type signalled struct {
	hup chan struct{} // a SIGHUP to handle: reload the rules (capacity 1)
	now chan struct{} // closed by a second SIGINT or SIGTERM: stop at once
}

// watchSignals reads signals until stop is called: SIGHUP asks for a
// reload, the first SIGINT or SIGTERM ends the returned context (the
// graceful shutdown), and one that comes after (or after ctx ended
// otherwise) logs one line and closes now.
func watchSignals(ctx context.Context, signals <-chan os.Signal, log *slog.Logger) (_ context.Context, _ *signalled, stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	s := &signalled{hup: make(chan struct{}, 1), now: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		for {
			var sig os.Signal
			select {
			case <-done:
				return
			case sig = <-signals:
			}
			switch {
			case sig == syscall.SIGHUP:
				select {
				case s.hup <- struct{}{}:
				default: // a reload is already due
				}
			case ctx.Err() == nil:
				cancel()
			default:
				log.Error("worker: second signal: stopping at once, without waiting for running tasks; asynq runs them again when their lease expires", "signal", sig.String())
				close(s.now)
				return
			}
		}
	}()
	return ctx, s, func() { close(done); cancel() }
}
