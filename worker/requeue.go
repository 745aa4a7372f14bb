package worker

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
)

// requeuer defers tasks that have no retry left by enqueueing a copy (see
// Options.Asynq).
type requeuer struct {
	client *asynq.Client
	insp   *asynq.Inspector
}

// revokedError is the error of a task parked as a copy
// (ThrottledError.Requeued): it matches the *admission.ThrottledError and
// asynq.RevokeTask, so that asynq drops the original instead of archiving
// it.
type revokedError struct{ *admission.ThrottledError }

func (e revokedError) Unwrap() []error { return []error{e.ThrottledError, asynq.RevokeTask} }

// copySuffix ends the ID of a requeued copy, followed by its generation.
const copySuffix = "~throttled"

// copy enqueues a copy of the task with ID id, scheduled for at, and
// returns the copy's ID. A copy already enqueued under that ID (by an
// earlier run of the same task whose revocation did not happen) counts as
// done.
func (q *requeuer) copy(ctx context.Context, task *asynq.Task, id string, at time.Time) (string, error) {
	queue, ok := asynq.GetQueueName(ctx)
	if !ok || id == "" {
		return "", errors.New("worker: requeue: the context carries no asynq task ID or queue")
	}
	info, err := q.insp.GetTaskInfo(queue, id)
	if err != nil {
		return "", fmt.Errorf("worker: requeue: reading task %s: %w", id, err)
	}
	copyID := nextCopyID(id)
	opts := []asynq.Option{
		asynq.Queue(queue),
		asynq.TaskID(copyID),
		asynq.ProcessAt(ceilSecond(at)),
		asynq.MaxRetry(max(info.MaxRetry-info.Retried, 0)),
	}
	if info.Timeout > 0 {
		opts = append(opts, asynq.Timeout(info.Timeout))
	}
	if !info.Deadline.IsZero() {
		opts = append(opts, asynq.Deadline(info.Deadline))
	}
	if info.Retention > 0 {
		opts = append(opts, asynq.Retention(info.Retention))
	}
	t := asynq.NewTaskWithHeaders(task.Type(), task.Payload(), task.Headers())
	if _, err := q.client.EnqueueContext(ctx, t, opts...); err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) {
		return "", fmt.Errorf("worker: requeue: enqueueing copy %s: %w", copyID, err)
	}
	return copyID, nil
}

// nextCopyID returns the ID of the next copy of task id: "<id>~throttled1",
// then "<id>~throttled2" for a copy of that copy, and so on.
func nextCopyID(id string) string {
	base, n := splitCopyID(id)
	return base + copySuffix + strconv.FormatUint(n+1, 10)
}

// splitCopyID returns the original's ID and n for the ID of a copy,
// "<id>~throttled<n>", and id and 0 for any other ID.
func splitCopyID(id string) (base string, n uint64) {
	if i := strings.LastIndex(id, copySuffix); i >= 0 {
		if k, err := strconv.ParseUint(id[i+len(copySuffix):], 10, 32); err == nil && k > 0 {
			return id[:i], k
		}
	}
	return id, 0
}
