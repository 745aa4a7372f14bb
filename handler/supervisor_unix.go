//go:build unix

package handler

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"
)

// supervisorName is the argv[0] under which runProgram starts the
// worker's own executable as a command's supervisor (it is what ps
// shows): any program that imports this package turns into the
// supervisor when started so, before its main runs.
const supervisorName = "jobthrottle-supervise"

// groupPoll is how often a group being stopped is checked for processes
// left.
const groupPoll = 10 * time.Millisecond

func init() {
	if len(os.Args) >= 4 && os.Args[0] == supervisorName {
		// syscall.Exit, not os.Exit: nothing of the program is to be
		// flushed, and a -race build would sleep a second at exit.
		syscall.Exit(supervise(os.Args[1], os.Args[2], os.Args[3:]))
	}
}

// supervise runs the program at path with argv as the leader of a new
// process group, and returns once no process of that group is left,
// having written how the program ended to fd 4 (see programError). Its
// fd 3 reads end of file when the worker has ended; SIGTERM means the
// worker stops the program.
//
//   - The program exits: processes it left in its group are stopped
//     (SIGTERM, then SIGKILL after grace).
//   - SIGTERM: the group is stopped the same way.
//   - The worker ends: the group is killed at once (SIGKILL); its task is
//     asynq's again, maybe already another worker's.
//
// A process that leaves the group (setsid, a daemon) is not stopped.
func supervise(graceArg, path string, argv []string) int {
	syscall.CloseOnExec(3) // not the program's
	syscall.CloseOnExec(4)
	worker, report := os.NewFile(3, "worker"), os.NewFile(4, "report")
	grace, err := time.ParseDuration(graceArg)
	if err != nil {
		fmt.Fprintf(report, "%sthe supervisor's grace %q: %v", reportStart, graceArg, err)
		return 1
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)
	// The program gets SIGKILL when the thread that started it ends
	// (Linux's parent-death signal, a safety net if the supervisor itself
	// is killed): this is the main thread, which lives as long as the
	// process.
	runtime.LockOSThread()
	becomeSubreaper()
	pid, err := syscall.ForkExec(path, argv, &syscall.ProcAttr{
		Env:   os.Environ(),
		Files: []uintptr{0, 1, 2},
		Sys:   leaderAttr(),
	})
	if err != nil {
		fmt.Fprintf(report, "%s%v", reportStart, err)
		return 0
	}
	leader := make(chan syscall.WaitStatus, 1)
	go reap(pid, leader)
	gone := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, worker) // the worker never writes
		close(gone)
	}()
	g := group{pgid: pid, grace: grace}
	var ws syscall.WaitStatus
	select {
	case ws = <-leader:
		g.stop(gone)
	case <-stop:
		g.stop(gone)
		ws = <-leader
	case <-gone:
		g.signal(syscall.SIGKILL)
		ws = <-leader
	}
	if ws.Signaled() {
		fmt.Fprintf(report, "%s%d", reportSignal, int(ws.Signal()))
	} else {
		fmt.Fprintf(report, "%s%d", reportExit, ws.ExitStatus())
	}
	return 0
}

// reap waits for the supervisor's children: the leader, whose status it
// sends, and on Linux the group's processes orphaned by their parents,
// which come to the supervisor (a subreaper) instead of init. It ends
// when no child is left.
func reap(leaderPID int, leader chan<- syscall.WaitStatus) {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		switch {
		case err == syscall.EINTR:
		case err != nil:
			return // ECHILD
		case pid == leaderPID:
			leader <- ws
		}
	}
}

// group is a command's process group.
type group struct {
	pgid  int
	grace time.Duration
}

func (g group) signal(sig syscall.Signal) { _ = syscall.Kill(-g.pgid, sig) }

// alive reports whether a process of the group is left (one that the
// supervisor may not signal counts).
func (g group) alive() bool { return syscall.Kill(-g.pgid, 0) != syscall.ESRCH }

// stop sends the group SIGTERM (and SIGCONT, for stopped processes) and
// SIGKILL once grace has passed, or at once when gone is closed, unless
// the group has ended by then.
func (g group) stop(gone <-chan struct{}) {
	if !g.alive() {
		return
	}

	g.signal(syscall.SIGTERM)
	g.signal(syscall.SIGCONT)
	deadline := time.NewTimer(g.grace)
	defer deadline.Stop()
	tick := time.NewTicker(groupPoll)
	defer tick.Stop()
	for g.alive() {
		select {
		case <-deadline.C:
			g.signal(syscall.SIGKILL)
			return
		case <-gone:
			g.signal(syscall.SIGKILL)
			return
		case <-tick.C:
		}
	}
}
