package worker

import (
	"errors"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
)

// How deferral works in asynq v0.26 (processor.go, internal/rdb/rdb.go):
//
// When a handler returns an error, the processor archives the task if
// msg.Retried >= msg.Retry (MaxRetry) or the error wraps asynq.SkipRetry,
// deletes it if the error wraps asynq.RevokeTask, and otherwise calls
// RDB.Retry(msg, now+RetryDelayFunc(...), err.Error(), IsFailure(err)).
// With isFailure false, Retry moves the task from active to the retry set
// without incrementing msg.Retried and without touching the processed and
// failed counters; the error text is kept as the task's last error. So a
// task deferred with a *admission.ThrottledError under IsFailure and RetryDelay keeps
// its retry count and all of its retries, however often it is deferred.
//
// Two limits of that path, handled here and in middleware.go:
//
//   - The retry set is scored in whole Unix seconds and the forwarder moves
//     a task once its score is <= the current Unix second, so a task
//     scheduled for 12.3 s would be released at 12.0 s. RetryDelay rounds
//     RetryAt up to the next whole second: a deferred task never runs
//     before its RetryAt, and runs within a second plus
//     asynq.Config.DelayedTaskCheckInterval after it.
//   - The MaxRetry check comes first: a task with no retry left
//     (MaxRetry(0), or its last attempt after real failures) is archived
//     whatever IsFailure says. The middleware does not defer such a task
//     by returning an error. With Options.Asynq it enqueues a copy scheduled
//     for RetryAt and revokes the original; without it, it waits in the
//     handler for as long as the task's deadline allows, ignoring MaxWait.

// minRetryDelay is the least delay RetryDelay gives a throttled task,
// before rounding up to the next whole second.
const minRetryDelay = time.Millisecond

// ErrDraining is the cause of a admission.ThrottledError for a task whose wait
// Middleware.Drain ended.
var ErrDraining = errors.New("worker: draining for shutdown; the task runs again on any worker")

// IsFailure reports whether err, returned by a handler, should count as a
// failure: false for nil and for a *admission.ThrottledError (anywhere in err's
// chain), true otherwise. Use it as asynq.Config.IsFailure, so that a
// deferred task neither uses up a retry nor counts as failed.
func IsFailure(err error) bool {
	if err == nil {
		return false
	}
	var te *admission.ThrottledError
	return !errors.As(err, &te)
}

// RetryDelay returns an asynq.RetryDelayFunc that schedules a task
// deferred with a *admission.ThrottledError for its RetryAt, rounded up to the next
// whole second (asynq's resolution), and at least a millisecond from now;
// every other error gets fallback, or asynq.DefaultRetryDelayFunc if
// fallback is nil. Use it as asynq.Config.RetryDelayFunc.
func RetryDelay(fallback asynq.RetryDelayFunc) asynq.RetryDelayFunc {
	if fallback == nil {
		fallback = asynq.DefaultRetryDelayFunc
	}
	return func(n int, err error, t *asynq.Task) time.Duration {
		var te *admission.ThrottledError
		if errors.As(err, &te) {
			return delayUntil(time.Now(), te.RetryAt)
		}
		return fallback(n, err, t)
	}
}

// delayUntil returns the delay from now to at, at least minRetryDelay,
// rounded so that now+delay is a whole second.
func delayUntil(now, at time.Time) time.Duration {
	return ceilSecond(later(at, now.Add(minRetryDelay))).Sub(now)
}

// ceilSecond rounds t up to a whole second. (Truncate counts from the zero
// time, which is a whole number of seconds from the Unix epoch.)
func ceilSecond(t time.Time) time.Time {
	s := t.Truncate(time.Second)
	if s.Before(t) {
		s = s.Add(time.Second)
	}
	return s
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// Configure returns c with IsFailure and RetryDelayFunc wrapped so that a
// task deferred with a *admission.ThrottledError is rescheduled for its RetryAt
// without counting a failure or using up a retry; every other error goes
// to c's own IsFailure and RetryDelayFunc (asynq's defaults if unset).
//
// It also shortens two of asynq's polling intervals, if zero, to
// CheckInterval (100ms): TaskCheckInterval (asynq's default is 1s), how
// long an idle processor sleeps before it looks for work again, so that a
// parked task woken just before its turn starts on time; and
// DelayedTaskCheckInterval (asynq's default 5s), how often due scheduled
// and retry tasks are moved to pending. Each costs an idle worker about ten
// small Redis calls a second.
func Configure(c asynq.Config) asynq.Config {
	own := c.IsFailure
	c.IsFailure = func(err error) bool {
		if !IsFailure(err) {
			return false
		}
		return own == nil || own(err)
	}
	c.RetryDelayFunc = RetryDelay(c.RetryDelayFunc)
	if c.DelayedTaskCheckInterval == 0 {
		c.DelayedTaskCheckInterval = CheckInterval
	}
	if c.TaskCheckInterval == 0 {
		c.TaskCheckInterval = CheckInterval
	}
	return c
}

// CheckInterval is the polling interval Configure gives asynq.
const CheckInterval = 100 * time.Millisecond
