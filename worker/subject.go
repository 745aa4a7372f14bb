package worker

import (
	"context"
	"errors"
	"fmt"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
)

// Subject derives from a task what a rule limits: a tenant, an account, a
// host. An error means the task can never be admitted: the middleware
// archives it at once with the reason (wrapping asynq.SkipRetry) rather
// than retrying it forever.
type Subject func(*asynq.Task) (string, error)

// Fixed returns a Subject that names s for every task: one limit shared
// by all tasks of the rule.
func Fixed(s string) Subject {
	return func(*asynq.Task) (string, error) { return s, nil }
}

// PayloadField returns a Subject read from the top-level field name of the
// task's JSON object payload. A string value is used as is; a number is
// used as written in the payload (so 42 and 42.0 are different subjects).
// A payload that is not a JSON object, a missing field, and a value that
// is null, empty, or not a string or number are errors.
func PayloadField(name string) Subject {
	return func(t *asynq.Task) (string, error) {
		return jsonpayload.Field(t.Payload(), name)
	}
}

// Priority gives a task its level in its subject's line, 0 to
// admission.MaxPriority (TaskRule.Priority); ctx is the handler's, which
// names the task's queue (asynq.GetQueueName). An error means the task can
// never be admitted: the middleware archives it, as for a Subject.
type Priority func(ctx context.Context, t *asynq.Task) (int, error)

// PayloadPriority returns a Priority read from the top-level field name of
// the task's JSON object payload: a whole number from 0 to
// admission.MaxPriority, or 0 if the payload has no such field. A payload
// that is not a JSON object, another type or a number out of range is an
// error.
func PayloadPriority(name string) Priority {
	return func(_ context.Context, t *asynq.Task) (int, error) {
		return jsonpayload.Level(t.Payload(), name, admission.MaxPriority)
	}
}

// QueuePriority returns a Priority that gives each task the level of its
// asynq queue in levels (such as {"critical": 2, "default": 1}); a queue
// not listed is 0. Levels out of 0 to admission.MaxPriority are errors when
// a task meets them.
func QueuePriority(levels map[string]int) Priority {
	return func(ctx context.Context, _ *asynq.Task) (int, error) {
		q, _ := asynq.GetQueueName(ctx)
		if lv := levels[q]; lv < 0 || lv > admission.MaxPriority {
			return 0, fmt.Errorf("queue %q has level %d; want 0 to %d", q, lv, admission.MaxPriority)
		}
		return levels[q], nil
	}
}

// ErrNoSubject is matched (errors.Is) by the error the middleware returns
// for a task whose subject cannot be derived. That error also matches
// asynq.SkipRetry, so asynq archives the task at once with the reason.
var ErrNoSubject = errors.New("worker: cannot derive the task's subject")

// archivedError is the middleware's error for a task that can never be
// admitted: no subject (it matches ErrNoSubject), no cost, or a cost
// beyond its rule's capacity. It matches asynq.SkipRetry, so asynq
// archives the task at once with the reason.
type archivedError struct {
	rule, taskID, taskType string
	noSubject              bool
	err                    error
}

func (e *archivedError) Error() string {
	what := ""
	if e.noSubject {
		what = "cannot derive the subject: "
	}
	return fmt.Sprintf("worker: rule %q: task %s (%s): %s%v; archived without retry", e.rule, e.taskID, e.taskType, what, e.err)
}

func (e *archivedError) Unwrap() []error {
	if e.noSubject {
		return []error{ErrNoSubject, e.err, asynq.SkipRetry}
	}
	return []error{e.err, asynq.SkipRetry}
}
