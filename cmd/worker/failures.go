package main

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/worker"
)

// failuresKept is how many of the handlers' latest failures the status
// page shows.
const failuresKept = 20

// maxFailureText bounds the error text kept for a failure, in bytes.
const maxFailureText = 500

// failure is a failed attempt of a handler, as the status page shows it.
type failure struct {
	At       time.Time
	Task     string // the task type
	ID       string
	Queue    string
	Rule     string // the rule that limits its type; "" if none
	Took     time.Duration
	Retried  int  // the retries it had used before this attempt
	MaxRetry int  // the retries it may use
	Retry    bool // asynq runs it again; else it is archived
	Error    string
}

// failureLog keeps the handlers' latest failures in memory: a ring of
// failuresKept, and the count since start.
type failureLog struct {
	mu    sync.Mutex
	ring  [failuresKept]failure
	count int64
}

// add records f.
func (l *failureLog) add(f failure) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ring[l.count%failuresKept] = f
	l.count++
}

// recent returns the failures kept, newest first, and the count since
// start.
func (l *failureLog) recent() ([]failure, int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := min(l.count, failuresKept)
	out := make([]failure, 0, n)
	for i := range n {
		out = append(out, l.ring[(l.count-1-i)%failuresKept])
	}
	return out, l.count
}

// observe returns next, whose failed attempts the status page lists: an
// error that asynq counts as a failure (worker.IsFailure: not a
// deferral) and that does not revoke the task. It adds no Redis call.
//
// Package handler counts the same attempts of the rules file's handlers
// (jobthrottle_handler_attempts_total) and logs each failure, but keeps
// none to read back: the page keeps its own ring, of every task the
// worker runs (the demo's, and a type with no handler, too).
func (s *status) observe(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		start := time.Now()
		err := next.ProcessTask(ctx, task)
		if worker.IsFailure(err) && !errors.Is(err, asynq.RevokeTask) {
			s.failures.add(s.failureOf(ctx, task, time.Since(start), err))
		}
		return err
	})
}

// failureOf is the failure err of task, after an attempt that took took.
func (s *status) failureOf(ctx context.Context, task *asynq.Task, took time.Duration, err error) failure {
	f := failure{At: time.Now(), Task: task.Type(), Took: took.Round(time.Millisecond), Error: err.Error()}
	if took < time.Millisecond {
		f.Took = took.Round(time.Microsecond)
	}
	f.ID, _ = asynq.GetTaskID(ctx)
	f.Queue, _ = asynq.GetQueueName(ctx)
	f.Retried, _ = asynq.GetRetryCount(ctx)
	f.MaxRetry, _ = asynq.GetMaxRetry(ctx)
	f.Retry = f.Retried < f.MaxRetry && !errors.Is(err, asynq.SkipRetry)
	if len(f.Error) > maxFailureText {
		f.Error = strings.ToValidUTF8(f.Error[:maxFailureText], "") + "…"
	}
	if rc, ok := s.rules().cfg.RuleFor(task.Type()); ok {
		f.Rule = rc.Name
	}
	return f
}
