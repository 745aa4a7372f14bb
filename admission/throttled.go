package admission

import (
	"context"
	"fmt"
	"time"
)

// ThrottledError reports that a job was not admitted in time and must
// come back at RetryAt: it is not a failure and must not use up a retry.
// The worker middleware returns it for a parked or deferred task, and a
// handler returns it when its upstream asks to slow down; the queue
// adapter maps it to the queue (worker.Configure: asynq's retry set,
// scheduled for RetryAt, without counting a failure). Its message becomes
// the task's last error, shown by the asynq inspector and asynqmon.
type ThrottledError struct {
	Rule    string    // the rule that throttled the job
	Subject string    // the subject the rule limited
	RetryAt time.Time // when the job may be admitted: the limiter's answer, or an estimate if Err says why not
	// Err is the cause: the adapter's reason (worker.ErrParked,
	// worker.ErrDraining), a *throttle.DelayError (the admission time is past the rule's MaxWait
	// or the job's deadline), an error matching throttle.ErrRedis (Redis
	// failed; RetryAt is a backoff), or context.DeadlineExceeded (the wait bound passed while the job was
	// queued behind others in this process).
	Err error
	// Requeued is the ID of a copy enqueued for RetryAt when the job had
	// no retry left, so that the original is dropped instead of retried
	// (the worker middleware's error for it then also matches
	// asynq.RevokeTask). Empty otherwise.
	Requeued string
}

// Error says that the job waits and is not failing, names the rule and
// subject, and when the work may run again: it is what a reader of
// asynq's inspector or asynqmon sees as the task's last error.
func (e *ThrottledError) Error() string {
	s := fmt.Sprintf("admission: waiting, not failed: rule %q, subject %q, runs again at %s", e.Rule, e.Subject, e.RetryAt.UTC().Format(time.RFC3339Nano))
	if e.Requeued != "" {
		s += "; requeued as task " + e.Requeued
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the cause.
func (e *ThrottledError) Unwrap() error { return e.Err }

// Wait tells a job's handler how it was admitted; see WaitedFrom.
type Wait struct {
	Rule     string        // the rule that admitted the job
	Subject  string        // the subject it limited
	Duration time.Duration // how long the job waited in place for its turn
	// Redeemed reports that the job ran on a turn booked before it
	// arrived: when it parked, or by its producer (ReceiptHeader).
	Redeemed bool
	// Turn is the job's turn on the Redis clock, if the rule's limiter
	// books turns (a *throttle.Limiter): when it was booked for, if
	// Redeemed.
	Turn time.Time
	// At is the same turn on the local monotonic clock, when Turn is set:
	// how late the job's handler acts for its turn is time.Since(At).
	At time.Time
}

type waitKey struct{}

// WithWait returns ctx carrying w, for the handler that runs the job. The
// worker middleware calls it for every task it admits.
func WithWait(ctx context.Context, w Wait) context.Context {
	return context.WithValue(ctx, waitKey{}, w)
}

// WaitedFrom returns how the job whose handler context is ctx was
// admitted, and false if no rule applied. Handlers may include it in
// their result (task.ResultWriter()); the worker middleware itself writes
// no result, so it never clobbers the handler's.
func WaitedFrom(ctx context.Context) (Wait, bool) {
	w, ok := ctx.Value(waitKey{}).(Wait)
	return w, ok
}
