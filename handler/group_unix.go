//go:build unix

package handler

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// runProgram runs p under a supervisor (see supervisor_unix.go): the
// worker's own executable, started again under the name supervisorName,
// which runs p as the leader of a new process group and ends when no
// process of that group is left. When ctx ends, the supervisor gets
// SIGTERM and stops the group: SIGTERM, then SIGKILL after p.grace. When
// the worker dies (or exits) first, the supervisor kills the group at
// once: it holds the read end of a pipe whose write end only the worker
// holds, and its end of file is the worker's death, whatever killed it.
// The supervisor reports how the program ended on a second pipe.
func runProgram(ctx context.Context, p program) error {
	self, err := selfExe()
	if err != nil {
		return fmt.Errorf("finding the worker's own executable, which supervises commands: %w", err)
	}
	lifeR, lifeW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer lifeW.Close() // after the supervisor ended
	reportR, reportW, err := os.Pipe()
	if err != nil {
		lifeR.Close()
		return err
	}
	defer reportR.Close()
	cmd := exec.CommandContext(ctx, self, append([]string{p.grace.String(), p.path}, p.argv...)...)
	cmd.Args[0] = supervisorName
	cmd.Env = p.env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = p.stdin, p.stdout, p.stderr
	cmd.ExtraFiles = []*os.File{lifeR, reportW} // its fds 3 and 4
	// Its own process group: a Ctrl-C meant for the worker does not reach
	// it; the worker decides when its commands stop.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	// The supervisor kills the group at the end of the grace; past that,
	// exec kills the supervisor and stops waiting for the output.
	cmd.WaitDelay = p.grace + waitDelay
	err = cmd.Start()
	lifeR.Close()
	reportW.Close()
	if err != nil {
		return err
	}
	waitErr := cmd.Wait()
	report, _ := io.ReadAll(reportR)
	return programError(string(report), waitErr)
}

// The supervisor's reports: how the program ended.
const (
	reportExit   = "exit "   // and the exit code
	reportSignal = "signal " // and the number of the signal that killed it
	reportStart  = "start "  // and why it could not start
)

// programError is the error of a run of a program from the supervisor's
// report and the supervisor's own end: nil for an exit with 0.
func programError(report string, waitErr error) error {
	switch {
	case strings.HasPrefix(report, reportExit):
		code, err := strconv.Atoi(report[len(reportExit):])
		switch {
		case err != nil:
		case code != 0:
			return &exitCodeError{code: code}
		default:
			return waitErr // exec.ErrWaitDelay: the output may be cut
		}
	case strings.HasPrefix(report, reportSignal):
		if n, err := strconv.Atoi(report[len(reportSignal):]); err == nil {
			return &signalError{name: syscall.Signal(n).String()}
		}
	case strings.HasPrefix(report, reportStart):
		return fmt.Errorf("starting the program: %s", report[len(reportStart):])
	}
	if waitErr == nil {
		waitErr = errors.New("it ended without a report")
	}
	return fmt.Errorf("the command's supervisor: %w (report %q)", waitErr, report)
}
