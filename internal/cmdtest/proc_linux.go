package cmdtest

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Process is a process that a command under test started, known by its
// PID and its start time, so that a PID reused after it ended is not
// taken for it.
type Process struct {
	PID   int
	start string // field 22 of /proc/PID/stat; "" if it had ended when read
}

// ReadPID waits, at most 30 s, until the file at path holds a PID and a
// newline (as `echo $! > path` writes it), and returns that process.
func ReadPID(t testing.TB, path string) Process {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		b, err := os.ReadFile(path)
		if s, ok := strings.CutSuffix(string(b), "\n"); err == nil && ok {
			pid, err := strconv.Atoi(s)
			if err != nil {
				t.Fatalf("%s holds %q, not a PID", path, b)
			}
			start, _ := procStat(pid)
			return Process{PID: pid, start: start}
		}
		if time.Now().After(end) {
			t.Fatalf("no PID was written to %s within 30s (%v)", path, err)
		}
	}
}

// procStat returns the start time and the state of process pid, from
// /proc; ok is false if there is no such process.
func procStat(pid int) (start string, state byte) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return "", 0
	}
	// pid (comm) state ppid pgrp ...: comm may hold spaces and ')'.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 20 {
		return "", 0
	}
	return f[19], f[0][0]
}

// Alive reports whether p is still running: the same process exists and
// is not a zombie (one that no parent reaped has ended).
func (p Process) Alive() bool {
	start, state := procStat(p.PID)
	return p.start != "" && start == p.start && state != 'Z'
}

// WaitGone fails t unless p has ended within 30 s; what names it in the
// message.
func (p Process) WaitGone(t testing.TB, what string) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); p.Alive(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Errorf("%s (PID %d) is still running 30s later", what, p.PID)
			return
		}
	}
}
