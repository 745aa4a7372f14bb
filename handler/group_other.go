//go:build !unix

package handler

import (
	"context"
	"errors"
	"os/exec"
)

// runProgram runs p. Without Unix process groups, only the program
// itself is killed when ctx ends (at once: p.grace is not used), and
// nothing ties it to the worker's life.
func runProgram(ctx context.Context, p program) error {
	cmd := exec.CommandContext(ctx, p.path, p.argv[1:]...)
	cmd.Args[0] = p.argv[0]
	cmd.Env = p.env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = p.stdin, p.stdout, p.stderr
	cmd.WaitDelay = waitDelay
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.Exited() {
		return &exitCodeError{code: ee.ExitCode()}
	}
	return err
}
