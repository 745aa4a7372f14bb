package handler_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
)

// spawn is a command that starts a grandchild and waits for it; $1 is a
// directory where both write their PIDs. The grandchild would outlive
// every deadline of the tests (cmdtest.Process.WaitGone's 30 s).
const spawn = `sleep 120 & echo $! > "$1/grandchild"; echo $$ > "$1/child"; wait`

// commandMux returns a mux with one command handler, for the task type
// "job": sh running script, whose $1 is the task's directory (see job).
func commandMux(t *testing.T, script, timeout, grace string) *asynq.ServeMux {
	t.Helper()
	file := fmt.Sprintf("handlers:\n  - task: job\n    command:\n      argv: [sh, -c, %q, sh, \"{dir}\"]\n      timeout: %s\n      stop_grace: %s\n",
		script, timeout, grace)
	c, err := handler.ParseConfig("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	mux := asynq.NewServeMux()
	getenv := func(k string) string {
		if k == "PATH" {
			return os.Getenv("PATH")
		}
		return ""
	}
	if err := c.Register(mux, handler.Options{Getenv: getenv, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); err != nil {
		t.Fatal(err)
	}
	return mux
}

// job is a task for commandMux's handler, with a directory of its own.
func job(t *testing.T) (*asynq.Task, string) {
	dir := t.TempDir()
	payload, _ := json.Marshal(map[string]string{"dir": dir})
	return asynq.NewTask("job", payload), dir
}

// runningJob is a task of commandMux's handler running in the background.
type runningJob struct {
	dir               string
	cancel            context.CancelFunc // ends the task's context
	done              chan error         // gets ProcessTask's result
	grandchild, child cmdtest.Process
}

// startJob starts a task running script, with no timeout and the given
// stop grace, and returns once script has written the PIDs of its
// grandchild and of itself.
func startJob(t *testing.T, script, grace string) runningJob {
	t.Helper()
	mux := commandMux(t, script, "10m", grace)
	task, dir := job(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r := runningJob{dir: dir, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- mux.ProcessTask(ctx, task) }()
	r.grandchild = cmdtest.ReadPID(t, filepath.Join(dir, "grandchild"))
	r.child = cmdtest.ReadPID(t, filepath.Join(dir, "child"))
	return r
}

// At the timeout, the command's whole process group is stopped, its
// grandchild with it, not only the program the handler started. The
// timeout leaves the script time to write its PIDs on a loaded machine
// (at 2 s, a CI run at load 14 under -race killed it before it had).
func TestCommandTimeoutStopsItsGroup(t *testing.T) {
	t.Parallel()
	mux := commandMux(t, spawn, "6s", "10m")
	task, dir := job(t)
	err := mux.ProcessTask(context.Background(), task)
	if err == nil || !strings.Contains(err.Error(), "killed after the timeout of 6s") {
		t.Errorf("got %v; want the timeout", err)
	}
	cmdtest.ReadPID(t, filepath.Join(dir, "grandchild")).WaitGone(t, "the grandchild")
	cmdtest.ReadPID(t, filepath.Join(dir, "child")).WaitGone(t, "the program")
}

// When the task's context ends (asynq cancels it at the worker's
// shutdown timeout, and when the task's lease is lost), the group is
// stopped; a group that ends on SIGTERM does not wait for the grace.
func TestCommandCancelStopsItsGroup(t *testing.T) {
	t.Parallel()
	r := startJob(t, spawn, "10m")
	r.cancel()
	select {
	case err := <-r.done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("got %v; want context.Canceled", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the handler did not return within a minute of the cancellation; the group ended at once on SIGTERM, so it waited for the 10m grace")
	}
	r.grandchild.WaitGone(t, "the grandchild")
	r.child.WaitGone(t, "the program")
}

// SIGTERM comes first: a program that traps it runs its trap; the
// processes that do not end on it (the program, and a grandchild that
// ignores it) get SIGKILL once the grace has passed, not before.
func TestCommandGetsSIGTERMThenSIGKILL(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	script := `trap 'echo term >> "$1/log"' TERM; (trap '' TERM; exec sleep 120) & echo $! > "$1/grandchild"; echo $$ > "$1/child"; while :; do sleep 0.1; done`
	r := startJob(t, script, grace.String())
	cancelled := time.Now()
	r.cancel()
	if err := <-r.done; !errors.Is(err, context.Canceled) {
		t.Errorf("got %v; want context.Canceled", err)
	}
	if took := time.Since(cancelled); took < grace {
		t.Errorf("the handler returned %v after the cancellation; the program traps SIGTERM, so it should have had the grace of %v", took, grace)
	}
	if b, err := os.ReadFile(filepath.Join(r.dir, "log")); err != nil || !strings.Contains(string(b), "term") {
		t.Errorf("the program's trap wrote %q (%v); want \"term\": SIGTERM first", b, err)
	}
	r.grandchild.WaitGone(t, "the grandchild, which ignores SIGTERM,")
	r.child.WaitGone(t, "the program, which traps SIGTERM,")
}

// A program that exits leaves nothing behind: what it started in its
// group is stopped, and the task's result does not wait for it.
func TestCommandLeftoversStopWhenItExits(t *testing.T) {
	t.Parallel()
	mux := commandMux(t, `sleep 120 & echo $! > "$1/grandchild"; echo done`, "10m", "10m")
	task, dir := job(t)
	if err := mux.ProcessTask(context.Background(), task); err != nil {
		t.Errorf("got %v; want success", err)
	}
	cmdtest.ReadPID(t, filepath.Join(dir, "grandchild")).WaitGone(t, "the program's background process")
}

// How a program ended reaches the task's error through the supervisor:
// its exit code, the signal that killed it, or why it did not start.
func TestCommandOutcomes(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, script, want string }{
		{"exit code", `echo oops >&2; exit 3`, `handler: sh exited with 3; will retry; stderr: "oops"`},
		{"no retry", `exit 65`, `handler: sh exited with 65 (no retry); archived without retry; (no stderr)`},
		{"signal", `kill -KILL $$`, `handler: sh: signal: killed; will retry`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			task, _ := job(t)
			err := commandMux(t, c.script, "10m", "5s").ProcessTask(context.Background(), task)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("got %v; want %s", err, c.want)
			}
		})
	}
	t.Run("not started", func(t *testing.T) {
		t.Parallel()
		prog := filepath.Join(t.TempDir(), "prog")
		if err := os.WriteFile(prog, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		c, err := handler.ParseConfig("rules.yaml", []byte(fmt.Sprintf("handlers:\n  - {task: job, command: {argv: [%q]}}\n", prog)))
		if err != nil {
			t.Fatal(err)
		}
		mux := asynq.NewServeMux()
		if err := c.Register(mux, handler.Options{}); err != nil {
			t.Fatal(err)
		}
		_ = os.Remove(prog) // after the look-up at Register
		err = mux.ProcessTask(context.Background(), asynq.NewTask("job", nil))
		want := "starting the program: no such file or directory; will retry"
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v; want %s", err, want)
		}
	})
}
