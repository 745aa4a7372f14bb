package handler

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
)

// StderrTail is how much of the end of a failed command's stderr goes
// into the task's error: 1 KiB.
const StderrTail = 1 << 10

// waitDelay bounds how long a command's output is awaited after it
// ended, or after its stop grace (processes that left its process group
// may hold the pipes open).
const waitDelay = 2 * time.Second

// commandHandler runs one command handler.
type commandHandler struct {
	spec Spec
	path string   // argv[0] looked up
	env  []string // resolved
}

func newCommandHandler(s Spec, opts Options) (*commandHandler, error) {
	path, err := exec.LookPath(s.Command.Argv[0])
	if err != nil {
		return nil, fmt.Errorf("command: %w", err)
	}
	h := &commandHandler{spec: s, path: path}
	// The worker's own environment may hold the Redis password: a command
	// gets PATH and what its env lists, nothing else.
	if p := opts.Getenv("PATH"); p != "" {
		h.env = append(h.env, "PATH="+p)
	}
	for _, e := range s.Command.Env {
		v, err := expandEnv(e.Value, opts.Getenv)
		if err != nil {
			return nil, fmt.Errorf("env %s: %w", e.Name, err)
		}
		h.env = append(h.env, e.Name+"="+v)
	}
	return h, nil
}

// ProcessTask runs the command with the task's payload on stdin.
func (h *commandHandler) ProcessTask(ctx context.Context, task *asynq.Task) error {
	args, err := h.args(task)
	if err != nil {
		return payloadError(task, err)
	}
	cs := h.spec.Command
	rctx, cancel := context.WithTimeout(ctx, cs.Timeout)
	defer cancel()
	stdout := &cappedBuffer{limit: h.spec.ResultLimit}
	stderr := &tailBuffer{size: StderrTail}
	err = runProgram(rctx, program{
		path:   h.path,
		argv:   append([]string{cs.Argv[0]}, args...),
		env:    append(slices.Clip(h.env), "JOBTHROTTLE_TASK_ID="+taskID(task), "JOBTHROTTLE_TASK_TYPE="+task.Type()),
		stdin:  bytes.NewReader(task.Payload()),
		stdout: stdout,
		stderr: stderr,
		grace:  cs.StopGrace,
	})
	name := cs.Argv[0]
	tail := func() string {
		s := strings.TrimSpace(strings.ToValidUTF8(string(stderr.b), "?"))
		if s == "" {
			return "(no stderr)"
		}
		return "stderr: " + strconv.Quote(s)
	}
	var exitErr *exitCodeError
	var sigErr *signalError
	switch {
	case err == nil:
		return writeResult(task, stdout.b, h.spec.ResultLimit)
	case rctx.Err() != nil && ctx.Err() == nil:
		ae := &attemptError{outcome: OutcomeTimeout, err: fmt.Errorf("handler: %s: killed after the timeout of %v; %s; %s", name, cs.Timeout, retryNote(ctx), tail())}
		if errors.As(err, &sigErr) {
			ae.signal = sigErr.name
		}
		return ae
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.As(err, &exitErr):
		code := exitErr.code
		ae := &attemptError{outcome: OutcomeExitNonzero, exitCode: code, err: fmt.Errorf("handler: %s exited with %d; %s; %s", name, code, retryNote(ctx), tail())}
		if slices.Contains(cs.NoRetryExitCodes, code) {
			ae.err = fmt.Errorf("handler: %s exited with %d (no retry); archived without retry; %s: %w", name, code, tail(), asynq.SkipRetry)
		}
		return ae
	case errors.As(err, &sigErr):
		return &attemptError{outcome: OutcomeSignal, signal: sigErr.name, err: fmt.Errorf("handler: %s: %v; %s; %s", name, err, retryNote(ctx), tail())}
	default:
		return fmt.Errorf("handler: %s: %v; %s; %s", name, err, retryNote(ctx), tail())
	}
}

// program is one run of a command handler's program.
type program struct {
	path   string   // the program's file, looked up
	argv   []string // argv[0] as written, then the arguments
	env    []string // all of its environment
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
	// grace is how long its processes have between SIGTERM and SIGKILL
	// when ctx ends.
	grace time.Duration
}

// exitCodeError is a program's exit with a code other than 0.
type exitCodeError struct{ code int }

func (e *exitCodeError) Error() string { return "exit status " + strconv.Itoa(e.code) }

// signalError is a program's end by a signal, named as Go names it
// ("killed", "segmentation fault").
type signalError struct{ name string }

func (e *signalError) Error() string { return "signal: " + e.name }

// args returns the command's arguments after the program, each
// placeholder argument replaced by its payload field, whole.
func (h *commandHandler) args(task *asynq.Task) ([]string, error) {
	argv := h.spec.Command.Argv
	out := make([]string, 0, len(argv)-1)
	for _, a := range argv[1:] {
		if field, ok := wholePlaceholder(a); ok {
			v, err := jsonpayload.Field(task.Payload(), field)
			if err != nil {
				return nil, fmt.Errorf("argv: %v", err)
			}
			a = v
		}
		out = append(out, a)
	}
	return out, nil
}

// wholePlaceholder reports whether a is exactly {field}, and the field.
func wholePlaceholder(a string) (string, bool) {
	loc := placeholderRE.FindStringSubmatchIndex(a)
	if loc == nil || loc[0] != 0 || loc[1] != len(a) {
		return "", false
	}
	return a[loc[2]:loc[3]], true
}
