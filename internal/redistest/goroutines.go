package redistest

import (
	"runtime"
	"strings"
)

// LimiterGoroutines lists the goroutines running a method of throttle's
// types (a place's renewal, a batch send, a lease call, an idle check),
// each as its stack: a test's own goroutines run plain functions. Tests
// of Close (throttle's, and of the worker that closes its limiters) check
// that none is left.
func LimiterGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var found []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "jobthrottle/throttle.(*") {
			found = append(found, g)
		}
	}
	return found
}
