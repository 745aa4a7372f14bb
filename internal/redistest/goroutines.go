package redistest

import (
	"regexp"
	"runtime"
	"strings"
)

// bubbleTag finds a goroutine's synctest bubble in its stack's header,
// "goroutine 7 [select, synctest bubble 3]:".
var bubbleTag = regexp.MustCompile(`^goroutine \d+ \[[^\]]*(synctest bubble \d+)\]`)

// LimiterGoroutines lists the goroutines running a method of throttle's
// types (a place's renewal, a batch send, a lease call, an idle check),
// each as its stack: a test's own goroutines run plain functions. Tests
// of Close (throttle's, and of the worker that closes its limiters) check
// that none is left.
//
// Called in a synctest bubble, it lists only the goroutines of that
// bubble, which are the ones the test's own limiters started: a goroutine
// another test left behind (a limiter it never closed, still dialling an
// unreachable Redis) is that test's defect, not this one's, and with
// -shuffle it would make the check fail by test order.
func LimiterGoroutines() []string {
	self := make([]byte, 256)
	self = self[:runtime.Stack(self, false)]
	bubble := ""
	if m := bubbleTag.FindSubmatch(self); m != nil {
		bubble = string(m[1])
	}
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var found []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if !strings.Contains(g, "jobthrottle/throttle.(*") {
			continue
		}
		if m := bubbleTag.FindStringSubmatch(g); bubble != "" && (m == nil || m[1] != bubble) {
			continue
		}
		found = append(found, g)
	}
	return found
}
