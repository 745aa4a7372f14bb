// Package cmdtest builds a command of this module once per test binary
// and runs it as a user would, for tests of exit codes and output.
//
//	func TestMain(m *testing.M) { os.Exit(cmdtest.Main(m)) }
//	code, stdout, stderr := cmdtest.Run(t, nil, "--check", "--config", path)
//
// On Linux, ReadPID and Process follow the processes that a command
// under test starts, to check that none outlives it.
//
// Imports: the standard library only; for tests only.
package cmdtest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

var (
	once sync.Once
	dir  string
	bin  string
	err  error
)

// Main runs the tests and then removes the binary Binary built. Call it
// from TestMain.
func Main(m *testing.M) int {
	code := m.Run()
	if dir != "" {
		_ = os.RemoveAll(dir)
	}
	return code
}

// Binary builds the command in the test's working directory (the
// package under test) once, and returns its path.
func Binary(t testing.TB) string {
	t.Helper()
	once.Do(func() {
		if dir, err = os.MkdirTemp("", "jobthrottle-cmdtest"); err != nil {
			return
		}
		bin = filepath.Join(dir, "cmd")
		if out, berr := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); berr != nil {
			err = fmt.Errorf("go build: %v\n%s", berr, out)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// Command returns the built command with args, its environment PATH and
// env only (nothing of the test's own environment).
func Command(t testing.TB, env []string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(Binary(t), args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	return cmd
}

// Run runs the built command to its end (at most 30 s) and returns its
// exit code, stdout and stderr.
func Run(t testing.TB, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, Binary(t), args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	runErr := cmd.Run()
	if ee, ok := runErr.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if runErr != nil {
		t.Fatal(runErr)
	}
	return code, out.String(), errb.String()
}
