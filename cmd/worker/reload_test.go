package main

import (
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// SIGHUP reloads the rules file: a new limit applies to the next tasks;
// a file that fails to load is logged and changes nothing; the process
// runs on, and no password shows.
func TestBinaryReload(t *testing.T) {
	t.Parallel()
	const password = "hunter2-reload"
	proc := redistest.Server(t, redistest.Args("--requirepass", password))
	rdb := redis.NewClient(&redis.Options{Addr: proc.Addr(), Password: password})
	t.Cleanup(func() { _ = rdb.Close() })
	insp := asynq.NewInspectorFromRedisClient(rdb)
	client := asynq.NewClientFromRedisClient(rdb)

	// A sliding window: its state, one count per bucket, reads the same
	// under any limit, and it books nothing ahead for tasks that run.
	prefix := redistest.Prefix(t)
	file := func(limit, period string) string {
		return `prefix: "` + prefix + `"
rules:
  - name: echo
    tasks: ["demo:echo"]
    subject: {fixed: all}
    algorithm: sliding_window
    limit: ` + limit + `
    period: ` + period + `
    max_wait: 100ms
`
	}
	path := writeRules(t, file("1", "1m"))
	rewrite := func(body string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	cmd, log := startBinary(t, []string{"REDIS_URL=redis://:" + password + "@" + proc.Addr() + "/0"}, "--config", path, "--demo", "--shutdown-timeout", "2s")
	enqueue := func() string {
		t.Helper()
		info, err := client.Enqueue(asynq.NewTask(TypeEcho, []byte(`{"tenant": "t", "message": "hi"}`)), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}
	// state waits until the task leaves pending and active, and returns
	// its state.
	state := func(id string) asynq.TaskState {
		t.Helper()
		for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			if info, err := insp.GetTaskInfo("default", id); err == nil && info.State != asynq.TaskStatePending && info.State != asynq.TaskStateActive {
				return info.State
			}
		}
		t.Fatalf("task %s still pending or active after 15s", id)
		return 0
	}
	hup := func() {
		t.Helper()
		if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	}
	log.waitFor(`msg="worker: processing"`)

	// 1 per minute: the first task runs, the next would park.
	if s := state(enqueue()); s != asynq.TaskStateCompleted {
		t.Fatalf("the first task: %v, want completed", s)
	}

	rewrite(file("3", "1m"))
	hup()
	log.waitFor(`level=INFO msg="worker: rules reloaded" file=` + regexp.QuoteMeta(path) + ` changed=\[echo\] added=\[\] removed=\[\]`)
	// 3 per minute: two more run at once, in the same minute.
	for range 2 {
		if s := state(enqueue()); s != asynq.TaskStateCompleted {
			t.Errorf("a task after the reload to 3/min: %v, want completed at once", s)
		}
	}

	rewrite(file("3", "0s"))
	hup()
	log.waitFor(`level=ERROR msg="worker: rules file not reloaded; the running rules stay" file=` + regexp.QuoteMeta(path) + ` error=.*period: \\"0s\\" must be at least 1µs`)
	// Still 3 per minute, all taken: the next task parks for its turn.
	id := enqueue()
	if s := state(id); s != asynq.TaskStateRetry {
		t.Errorf("a fourth task in the minute: %v, want parked (retry) under the running 3/min", s)
	}
	if info, err := insp.GetTaskInfo("default", id); err != nil || !strings.Contains(info.LastErr, "parked") || info.Retried != 0 {
		t.Errorf("the fourth task: %+v, %v; want parked, not failed", info, err)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	log.waitFor(`msg="worker: stopped"`)
	all := log.rest()
	if err := cmd.Wait(); err != nil {
		t.Errorf("exit: %v, want 0:\n%s", err, all)
	}
	if strings.Contains(all, password) {
		t.Errorf("the password shows in the log:\n%s", all)
	}
}
