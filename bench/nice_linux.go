//go:build linux

package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// renice sets the scheduling priority of every thread of this process
// (Linux keeps one per thread); threads, children and the redis-server
// started later inherit it. With autogroup scheduling, a nice value only
// weighs against processes of the same session, so it also sets this
// session's autogroup priority where the kernel has one; restore puts that
// back, as it is shared with the session's other processes.
func renice(n int) (restore func(), err error) {
	restore = func() {}
	if b, err := os.ReadFile("/proc/self/autogroup"); err == nil {
		// "/autogroup-7 nice 0"
		if f := strings.Fields(string(b)); len(f) == 3 {
			old := f[2]
			if os.WriteFile("/proc/self/autogroup", []byte(strconv.Itoa(n)), 0) == nil {
				restore = func() { _ = os.WriteFile("/proc/self/autogroup", []byte(old), 0) }
			}
		}
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return restore, err
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := syscall.Setpriority(syscall.PRIO_PROCESS, tid, n); err != nil {
			return restore, err
		}
	}
	return restore, nil
}

// apart makes cmd die with the bench and, if session, run as another
// session's work: its own session, so its own autogroup, which renice(0)
// in the child then leaves at nice 0.
func apart(cmd *exec.Cmd, session bool) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: session, Pdeathsig: syscall.SIGKILL}
}
