package handler

import "syscall"

// selfExe is the running executable, even if its file was replaced or
// removed since it started.
func selfExe() (string, error) { return "/proc/self/exe", nil }

// leaderAttr puts a command in a new process group and has the kernel
// kill it (SIGKILL) when the supervisor's thread that started it ends.
func leaderAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// prSetChildSubreaper is PR_SET_CHILD_SUBREAPER of linux/prctl.h.
const prSetChildSubreaper = 36

// becomeSubreaper makes the processes that the supervisor's descendants
// orphan its children rather than init's, so that it reaps them: a
// group of zombies would never look empty where init does not reap (a
// container whose PID 1 is the worker).
func becomeSubreaper() {
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0)
}
