//go:build unix && !linux

package handler

import (
	"os"
	"syscall"
)

// selfExe is the running executable's path.
func selfExe() (string, error) { return os.Executable() }

// leaderAttr puts a command in a new process group.
func leaderAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

// becomeSubreaper does nothing: orphans go to init, which reaps them.
func becomeSubreaper() {}
