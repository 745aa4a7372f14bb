package redistest

import "syscall"

// sysProcAttr makes the kernel kill a started redis-server when the test
// binary dies (a -timeout panic, say) before its cleanups run, so no server
// outlives the tests. Pdeathsig fires when the thread that started the child
// exits; Go only ends threads whose goroutine exits while locked to them,
// which nothing in this project's tests does.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
