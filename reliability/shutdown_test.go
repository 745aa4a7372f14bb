package reliability

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestWorkerShutdown runs the built cmd/worker (concurrency 10, shutdown
// timeout 5s) on 40 demo:echo tasks of one tenant under a rule of 2 per
// second with a 30s max wait: two tasks wait in their slots (wait_slots'
// default) and the others park, their turns booked up to 20s ahead (the
// rule's horizon is 30s, so none waits in the line unbooked).
// SIGTERM must make it exit 0 within the shutdown timeout, with no task
// active or archived and every task accounted for; the ledger must hold no
// more than the turns of the tasks left (a turn booked twice, or a waiting
// task's turn kept as well as re-booked, would push it further); a second
// worker then runs every task, each exactly once and none with a failure
// counted.
func TestWorkerShutdown(t *testing.T) {
	t.Parallel() // long; overlaps TestAsynqThroughRedisOutage, which mostly waits
	bin := buildBinary(t, "cmd/worker")
	srv := redistest.Server(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	prefix := redistest.Prefix(t)
	rulesFile := func(perSecond int) string {
		path := filepath.Join(t.TempDir(), "rules.yaml")
		if err := os.WriteFile(path, fmt.Appendf(nil, `prefix: %q
rules:
  - name: echo
    tasks: ["demo:echo"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: %d
    period: 1s
    burst: 1
    max_wait: 30s
    horizon: 30s
`, prefix, perSecond), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	const tasks, shutdownTimeout = 40, 5 * time.Second
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range tasks {
		task := asynq.NewTask("demo:echo", fmt.Appendf(nil, `{"tenant": "acme", "message": "m%d"}`, i))
		if _, err := client.Enqueue(task, asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	args := func(perSecond int) []string {
		return []string{"--redis", srv.URL(), "--config", rulesFile(perSecond), "--demo", "--concurrency", "10",
			"--shutdown-timeout", shutdownTimeout.String(), "--log-level", "info"}
	}

	// ahead returns how far ahead of Redis's clock the rule's GCRA state
	// (its theoretical arrival time, whole µs, in throttle/lua/bucket.lua's
	// state: the compact form's first 7 bytes, less 0xF0 << 48, or the
	// decimal form's first field) stands: how long a new task would wait.
	key := prefix + "{acme}:echo"
	ahead := func() time.Duration {
		s, err := rdb.Get(ctx, key).Result()
		if err != nil {
			return 0 // no key: nothing booked
		}
		var v float64
		if len(s) == 12 && s[0] >= 0xF0 {
			var tat int64
			for _, c := range []byte(s[:7]) {
				tat = tat<<8 | int64(c)
			}
			v = float64(tat - 0xF0<<48)
		} else if v, err = strconv.ParseFloat(strings.Fields(s)[0], 64); err != nil {
			t.Fatalf("GCRA state %q: %v", s, err)
		}
		now, err := rdb.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		return time.Duration(v-float64(now.UnixMicro())) * time.Microsecond
	}

	w := startProcess(t, nil, bin, args(2)...)
	w.waitFor(t, "worker: processing", 30*time.Second)
	// Let the tasks park: their turns booked up to ~20s ahead at 2/s.
	var booked time.Duration
	for deadline := time.Now().Add(15 * time.Second); booked < 15*time.Second; time.Sleep(50 * time.Millisecond) {
		booked = ahead()
		if time.Now().After(deadline) {
			t.Fatalf("the worker's tasks booked only %v ahead; want ~20s (40 tasks at 2/s):\n%s", booked, w.out)
		}
	}
	before, _ := insp.GetQueueInfo("default")
	took := w.stop(t, syscall.SIGTERM, shutdownTimeout+10*time.Second)
	left := ahead()
	after, err := insp.GetQueueInfo("default")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("SIGTERM with %d tasks active (%d done), reservations booked %v ahead: exited in %v; afterwards %v booked, %d active, %d pending, %d retry, %d scheduled, %d completed, %d archived",
		before.Active, before.Completed, booked.Round(time.Millisecond), took.Round(time.Millisecond), left.Round(time.Millisecond),
		after.Active, after.Pending, after.Retry, after.Scheduled, after.Completed, after.Archived)
	if took > shutdownTimeout+2*time.Second {
		t.Errorf("the worker took %v to exit after SIGTERM; want within its shutdown timeout (%v, +2s to start and stop the process)", took, shutdownTimeout)
	}
	if bound := time.Duration(tasks-after.Completed)*500*time.Millisecond + time.Second; left > bound {
		t.Errorf("after shutdown the rule is booked %v ahead, more than the %d tasks left can hold (%v): a turn was kept twice", left, tasks-after.Completed, bound)
	}
	if after.Active != 0 || after.Archived != 0 {
		t.Errorf("after shutdown: %d tasks active, %d archived; want 0 and 0 (the waiting ones put back)", after.Active, after.Archived)
	}
	if got := after.Pending + after.Retry + after.Scheduled + after.Completed; got != tasks {
		t.Errorf("after shutdown %d tasks accounted for (pending+retry+scheduled+completed); want %d", got, tasks)
	}

	// A second worker finishes the job (at 40/s, not to wait 20s).
	w2 := startProcess(t, nil, bin, args(40)...)
	w2.waitFor(t, "worker: processing", 30*time.Second)
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		qi, err := insp.GetQueueInfo("default")
		if err == nil && qi.Completed == tasks {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not every task completed within 2 minutes: %+v (%v)\n%s", qi, err, w2.out)
		}
	}
	w2.stop(t, syscall.SIGTERM, shutdownTimeout+10*time.Second)
	completed, err := insp.ListCompletedTasks("default", asynq.PageSize(2*tasks))
	if err != nil {
		t.Fatal(err)
	}
	msgs := map[string]int{}
	for _, ti := range completed {
		msgs[string(ti.Payload)]++
		if ti.Retried != 0 {
			t.Errorf("task %s (%s) completed with %d failures counted (%q); a shutdown must not count one", ti.ID, ti.Payload, ti.Retried, ti.LastErr)
		}
	}
	for i := range tasks {
		p := `{"tenant": "acme", "message": "m` + strconv.Itoa(i) + `"}`
		if msgs[p] != 1 {
			t.Errorf("task m%d completed %d times; want exactly once", i, msgs[p])
		}
	}
}
