package reliability

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// asynq v0.26 gives each task to a worker under a lease of 30 s that the
// worker's heartbeat (every 5 s) extends; the lease is a constant
// (internal/rdb.LeaseDuration), no Config field shortens it. Its
// recoverer, which runs when a server starts and then once a minute, takes
// back a task whose lease expired at least 30 s ago (its allowance for
// clock skew). A task whose worker died, or whose completion asynq lost,
// therefore comes back one to two minutes later: asynq's waits, not what
// these tests check. The helpers below skip them: they age the leases of
// the dead worker's tasks, as if those minutes had passed, and leave the
// recovery itself to asynq's own recoverer (Retried+1, ErrLeaseExpired,
// the server's RetryDelayFunc), which a server runs when it starts.

// asynqHeartbeat is how often an asynq v0.26 server extends the leases of
// the tasks it runs (server.go, the heartbeater's interval).
const asynqHeartbeat = 5 * time.Second

// leaseKey is asynq's sorted set of task leases for queue (score: when the
// lease expires, in Unix seconds).
func leaseKey(queue string) string { return "asynq:{" + queue + "}:lease" }

// leasesHeldSince returns the tasks of queue whose leases no live worker
// has extended since at: those that a worker that died at at held, or
// that asynq lost track of at at. It first waits until two heartbeats and
// a second have passed since at, so that every live worker has extended
// each of its own leases at least once since the second after at: to
// after at + 30s (leases are whole seconds).
func leasesHeldSince(t *testing.T, rdb redis.UniversalClient, queue string, at time.Time) []string {
	t.Helper()
	if wait := time.Until(at.Add(2*asynqHeartbeat + time.Second)); wait > 0 {
		time.Sleep(wait)
	}
	ids, err := rdb.ZRangeByScore(context.Background(), leaseKey(queue),
		&redis.ZRangeBy{Min: "-inf", Max: fmt.Sprint(at.Add(30 * time.Second).Unix())}).Result()
	if err != nil {
		t.Fatalf("reading asynq's leases: %v", err)
	}
	return ids
}

// ageLeases moves the leases of ids (tasks of queue that are still
// active) 61 s into the past: expired more than asynq's 30 s allowance
// ago, so that the recoverer of the next asynq server to start takes them
// back. A task no longer leased is left alone.
func ageLeases(t *testing.T, rdb redis.UniversalClient, queue string, ids []string) {
	t.Helper()
	if len(ids) == 0 {
		return
	}
	past := float64(time.Now().Add(-61 * time.Second).Unix())
	zs := make([]redis.Z, len(ids))
	for i, id := range ids {
		zs[i] = redis.Z{Score: past, Member: id}
	}
	if err := rdb.ZAddXX(context.Background(), leaseKey(queue), zs...).Err(); err != nil {
		t.Fatalf("ageing asynq's leases: %v", err)
	}
}

// runRecovered waits until asynq's recoverer has put each of ids back as
// a task to retry (with ErrLeaseExpired its last error) and runs it at
// once, as `asynq task run` would: the backoff asynq then gives a failed
// task (its DefaultRetryDelayFunc, 15-44 s at the first retry, when the
// server sets no RetryDelayFunc of its own) is asynq's policy, not what the
// tests check. A task already run, or gone, is left alone.
func runRecovered(t *testing.T, insp *asynq.Inspector, queue string, ids []string, d time.Duration) {
	t.Helper()
	for _, id := range ids {
		for deadline := time.Now().Add(d); ; time.Sleep(50 * time.Millisecond) {
			info, err := insp.GetTaskInfo(queue, id)
			if err != nil {
				t.Fatalf("task %s, leased by the dead worker: %v", id, err)
			}
			if info.State == asynq.TaskStateRetry {
				if !strings.Contains(info.LastErr, asynq.ErrLeaseExpired.Error()) {
					t.Fatalf("task %s, leased by the dead worker, is to retry with last error %q; want asynq's %q", id, info.LastErr, asynq.ErrLeaseExpired)
				}
				if err := insp.RunTask(queue, id); err != nil {
					t.Fatalf("running task %s: %v", id, err)
				}
				break
			}
			if info.State != asynq.TaskStateActive {
				break // recovered and run already, or never held
			}
			if time.Now().After(deadline) {
				t.Fatalf("task %s, leased by the dead worker, still active %v after its lease was aged: asynq's recoverer did not take it back", id, d)
			}
		}
	}
}
