package reliability

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestFleetKilledMidBacklog runs three built cmd/worker processes on
// backlogs of hot tenants' demo:echo tasks and then 10 of a cold one, and
// kills one worker with SIGKILL after 5s. The other two go on, and the
// dead one is restarted (after its leases are aged: asynq's 30s lease and
// its recoverer's period are not waited out, see recovery_test.go): every
// task completes exactly once (those the dead worker was running come back
// through asynq's own recovery, the only failures counted), no turn of one
// tenant passes 20 + 1 in any second on the Redis clock (a task's result
// carries its turn), nor the key's its limit + 1, and the cold tenant's
// tasks get their turns within 3s of being enqueued although the hot ones
// were ahead of them in the queue. Two rule files: a limit per tenant (300
// hot tasks), and one API key at 40/s shared by the tenants (fair_by), each
// also limited to 20/s of it (share_limit; two hot tenants of 300 tasks).
func TestFleetKilledMidBacklog(t *testing.T) {
	for _, tc := range []struct {
		name  string
		rule  string
		hot   []string // hot tenants, 300 tasks each
		keyAt int      // the key's limit per second, 0 if none
	}{
		{"per tenant", `
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 20`, []string{"hot"}, 0},
		{"share limits", `
    subject: {fixed: key-1}
    fair_by: {payload_field: tenant}
    share_limit: {limit: 20, period: 1s, burst: 1}
    algorithm: gcra
    limit: 40`, []string{"hot", "warm"}, 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			killMidBacklog(t, tc.rule, tc.hot, tc.keyAt)
		})
	}
}

func killMidBacklog(t *testing.T, rule string, hots []string, keyAt int) {
	t.Parallel() // mostly waits: 300 turns at 20/s
	bin := buildBinary(t, "cmd/worker")
	srv := redistest.Server(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	rules := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(rules, fmt.Appendf(nil, `prefix: %q
rules:
  - name: echo
    tasks: ["demo:echo"]%s
    period: 1s
    burst: 1
    max_wait: 1s
`, prefix, rule), 0o644); err != nil {
		t.Fatal(err)
	}
	var workers []*process
	for range 3 {
		w := startProcess(t, nil, bin, "--redis", srv.URL(), "--config", rules, "--demo", "--concurrency", "10", "--log-level", "info")
		workers = append(workers, w)
	}
	for _, w := range workers {
		w.waitFor(t, "worker: processing", 30*time.Second)
	}

	const hot, cold = 300, 10
	total := hot*len(hots) + cold
	client := asynq.NewClientFromRedisClient(rdb)
	enqueue := func(tenant string, n int) time.Time {
		for i := range n {
			task := asynq.NewTask("demo:echo", fmt.Appendf(nil, `{"tenant": %q, "message": "%s-%d"}`, tenant, tenant, i))
			if _, err := client.Enqueue(task, asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
		return time.Now()
	}
	for _, h := range hots {
		enqueue(h, hot)
	}
	coldEnqueued := enqueue("cold", cold)

	time.Sleep(5 * time.Second)
	if err := workers[0].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	// The tasks the dead worker held come back through asynq's recovery,
	// without waiting out asynq's lease (see recovery_test.go): their
	// leases are aged, the dead worker is restarted (as a supervisor
	// would) and its recoverer, which runs as it starts, takes them back.
	insp := asynq.NewInspectorFromRedisClient(rdb)
	held := leasesHeldSince(t, rdb, "default", killed)
	if len(held) > 10 {
		t.Fatalf("%d tasks leased by the dead worker, more than its 10 slots: %v", len(held), held)
	}
	ageLeases(t, rdb, "default", held)
	restarted := startProcess(t, nil, bin, workers[0].cmd.Args[1:]...)
	restarted.waitFor(t, "worker: processing", 30*time.Second)
	runRecovered(t, insp, "default", held, 30*time.Second)
	var q *asynq.QueueInfo
	for deadline := time.Now().Add(4 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		var err error
		if q, err = insp.GetQueueInfo("default"); err == nil && q.Completed == total {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not every task completed within 4 minutes of the kill: %+v, %v", q, err)
		}
	}
	done := time.Since(killed)
	if q.Archived != 0 {
		t.Errorf("%d tasks archived, want none", q.Archived)
	}
	completed, err := insp.ListCompletedTasks("default", asynq.PageSize(2*total))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	turns := map[string][]time.Time{}
	recovered := 0
	for _, ti := range completed {
		var p struct{ Tenant, Message string }
		var r struct {
			Turn   time.Time `json:"turn"`
			Booked bool      `json:"booked"`
		}
		if err := json.Unmarshal(ti.Payload, &p); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(ti.Result, &r); err != nil || r.Turn.IsZero() {
			t.Fatalf("task %s result %q: %v; want its turn", ti.ID, ti.Result, err)
		}
		seen[p.Message]++
		turns[p.Tenant] = append(turns[p.Tenant], r.Turn)
		if ti.Retried > 0 {
			recovered++
		}
	}
	for _, tenant := range append(slices.Clone(hots), "cold") {
		for n := range map[bool]int{true: cold, false: hot}[tenant == "cold"] {
			if m := fmt.Sprintf("%s-%d", tenant, n); seen[m] != 1 {
				t.Errorf("task %s completed %d times, want once", m, seen[m])
			}
		}
	}
	if len(completed) != total {
		t.Errorf("%d tasks completed, want %d", len(completed), total)
	}
	// Only the tasks the dead worker held (at most its 10 slots) may have
	// a failure counted: asynq's recovery of a task whose worker died.
	if recovered > 10 {
		t.Errorf("%d tasks completed with a failure counted, want at most the dead worker's 10", recovered)
	}
	var all []time.Time
	for tenant, ts := range turns {
		if most := redistest.MaxInWindow(ts, time.Second); most > 21 {
			t.Errorf("tenant %s: %d turns in one second on the Redis clock, want at most 21", tenant, most)
		}
		all = append(all, ts...)
	}
	if most := redistest.MaxInWindow(all, time.Second); keyAt > 0 && most > keyAt+1 {
		t.Errorf("the key: %d turns in one second on the Redis clock, want at most %d", most, keyAt+1)
	}
	slices.SortFunc(turns["cold"], time.Time.Compare)
	// The cold tenant's 10 turns take under a second of its fair share;
	// before them the workers must dequeue the hot backlog ahead of them
	// in asynq's queue (each a park decision: 0.5-1.3 s measured on a quiet
	// 2-core machine, main and the commit before alike). Waiting behind the
	// hot backlog, the failure guarded against, would take 15 s.
	late := turns["cold"][len(turns["cold"])-1].Sub(coldEnqueued)
	if late > 3*time.Second {
		t.Errorf("the last cold task's turn came %v after it was enqueued, want within 3s", late)
	}
	t.Logf("the last cold task's turn came %v after it was enqueued", late.Round(time.Millisecond))
	stats, _ := rdb.Info(context.Background(), "stats").Result()
	for _, l := range strings.Split(stats, "\n") {
		if strings.HasPrefix(l, "total_commands_processed:") {
			t.Logf("%d tasks, 1 worker of 3 killed holding %d, restarted: %d recovered by asynq, all done %v after the kill; Redis %s (asynq's and jobthrottle's, for the whole run)",
				total, len(held), recovered, done.Round(time.Millisecond), strings.TrimSpace(l))
		}
	}
}
