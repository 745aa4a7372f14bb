//go:build linux

package main

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes the kernel kill cmd's process if the bench dies
// (SIGKILL included), so that a fleet run leaves no server or child behind.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
