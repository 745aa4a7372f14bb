//go:build unix

package handler_test

import (
	"fmt"
	"testing"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/handler"
)

// A failing command: an exit code, a no-retry exit code, a kill at the
// timeout (SIGTERM from the supervisor) and a signal from elsewhere are
// each one attempt counted by outcome and one failure line with the
// exit code or the signal.
func TestCommandAttemptsObserved(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		outcomeCase
		script string
	}{
		{outcomeCase{"ok", handler.OutcomeSuccess, "", nil}, "true"},
		{outcomeCase{"exit 3", handler.OutcomeExitNonzero, "WARN", map[string]any{"exit_code": 3.0}}, "exit 3"},
		{outcomeCase{"exit 65", handler.OutcomeExitNonzero, "ERROR", map[string]any{"exit_code": 65.0}}, "exit 65"},
		{outcomeCase{"killed at the timeout", handler.OutcomeTimeout, "WARN", map[string]any{"signal": "terminated"}}, "exec sleep 60"},
		{outcomeCase{"killed by a signal", handler.OutcomeSignal, "WARN", map[string]any{"signal": "killed"}}, "kill -KILL $$"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			// Only the case about the timeout meets it: a loaded machine
			// can take longer than 300ms to start sh for the others.
			timeout := "30s"
			if c.outcome == handler.OutcomeTimeout {
				timeout = "300ms"
			}
			file := fmt.Sprintf("handlers:\n  - {task: job, command: {argv: [sh, -c, %q], timeout: %s, stop_grace: 5s}}\n", c.script, timeout)
			mux, reg, logs := observedMux(t, file, handler.Options{})
			checkOutcome(t, mux, reg, logs, asynq.NewTask("job", []byte(`{}`)), "command", c.outcomeCase)
		})
	}
}
