package main

import (
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// A worker's commands do not outlive it, whether it is killed (SIGKILL)
// or ends at its shutdown timeout with a command still running: their
// whole process groups end with it, although they ignore SIGTERM and may
// take ten minutes to stop. asynq hands their tasks to another worker.
func TestBinaryCommandsEndWithTheWorker(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		sig  syscall.Signal
	}{
		{"killed", syscall.SIGKILL},
		{"shutdown timeout", syscall.SIGTERM}, // --shutdown-timeout 1s
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			proc := redistest.Server(t)
			script := `trap '' TERM; sleep 120 & echo $! > "$1/grandchild"; echo $$ > "$1/child"; wait`
			rules := writeRules(t, fmt.Sprintf(`rules:
  - {name: jobs, tasks: ["job:*"], subject: {fixed: all}, algorithm: gcra, limit: 100, period: 1s}
handlers:
  - task: job:run
    command:
      argv: [sh, -c, %q, sh, "{dir}"]
      timeout: 10m
      stop_grace: 10m
`, script))
			cmd, log := startBinary(t, []string{"REDIS_URL=" + proc.URL()}, "--config", rules, "--shutdown-timeout", "1s")
			go log.rest()
			dir := t.TempDir()
			payload, _ := json.Marshal(map[string]string{"dir": dir})
			if _, err := asynq.NewClientFromRedisClient(proc.Client(t)).Enqueue(asynq.NewTask("job:run", payload), asynq.Timeout(time.Hour)); err != nil {
				t.Fatal(err)
			}
			grandchild := cmdtest.ReadPID(t, filepath.Join(dir, "grandchild"))
			child := cmdtest.ReadPID(t, filepath.Join(dir, "child"))
			if err := cmd.Process.Signal(c.sig); err != nil {
				t.Fatal(err)
			}
			grandchild.WaitGone(t, "the command's grandchild")
			child.WaitGone(t, "the command")
			waitExit(t, cmd)
		})
	}
}

// waitExit fails t unless cmd has exited within 30 s.
func waitExit(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Error("the worker did not exit within 30s")
	}
}
