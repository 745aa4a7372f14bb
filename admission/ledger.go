package admission

import (
	"fmt"
	"strconv"
	"strings"
)

// The wake-up ledger (Wakeups) holds two kinds of entries, each a type
// with its own encoding: a parked job to wake (JobEntry), which the queue
// adapter moves back to its queue, and a subject's line or places to
// serve (LineEntry), which the process that has the gate of that name
// serves (Parking). Both are written as parts joined by Member, so that
// producers and workers of every version read one ledger.

// Entry is one wake-up of the ledger: a JobEntry or a LineEntry.
type Entry interface {
	// Member returns the entry as the ledger keeps it.
	Member() string
	entry()
}

// JobEntry is a parked job's wake-up: its queue (never empty) and its ID
// in that queue.
type JobEntry struct {
	Queue string
	ID    string
}

// Member returns Member(e.Queue, e.ID). It is also the job's name under a
// Concurrency rule and in its subject's line (Request.Waiter, WaitAs), so
// that the serving or hand-off that books its turn wakes it.
func (e JobEntry) Member() string { return Member(e.Queue, e.ID) }

func (JobEntry) entry() {}

// LineEntry is the serving of a subject's line under the gate named Rule
// (Options.Name), or, for a gate with a Concurrency rule, the sweep of
// that subject's places. Passed counts how often a process without that
// gate has put it back for another (Parking.Run drops it after a bound).
type LineEntry struct {
	Rule    string
	Subject string
	Passed  int
}

// Member returns the entry as the ledger keeps it: an empty queue name
// (which no job has), the rule, the subject, and Passed if not zero.
func (e LineEntry) Member() string {
	if e.Passed > 0 {
		return Member("", e.Rule, e.Subject, strconv.Itoa(e.Passed))
	}
	return Member("", e.Rule, e.Subject)
}

func (LineEntry) entry() {}

// ParseEntry decodes a ledger member written by JobEntry.Member or
// LineEntry.Member. It returns an error for any other text.
func ParseEntry(member string) (Entry, error) {
	parts, ok := Split(member)
	switch {
	case !ok:
	case len(parts) == 2 && parts[0] != "":
		return JobEntry{Queue: parts[0], ID: parts[1]}, nil
	case len(parts) == 3 && parts[0] == "":
		return LineEntry{Rule: parts[1], Subject: parts[2]}, nil
	case len(parts) == 4 && parts[0] == "":
		passed, err := strconv.Atoi(parts[3])
		if err != nil || passed < 0 {
			break
		}
		return LineEntry{Rule: parts[1], Subject: parts[2], Passed: passed}, nil
	}
	return nil, fmt.Errorf("admission: wake-up %q is neither a job (queue, ID) nor a line (rule, subject); remove it from the ledger", member)
}

// Member joins parts into one ledger member that Split takes apart: each
// part is length-prefixed, so parts may contain any byte. JobEntry and
// LineEntry are written with it.
func Member(parts ...string) string {
	var b strings.Builder
	for _, p := range parts {
		fmt.Fprintf(&b, "%d:%s", len(p), p)
	}
	return b.String()
}

// Split takes apart a member made by Member; ok is false if it is not one.
func Split(member string) (parts []string, ok bool) {
	for member != "" {
		i := strings.IndexByte(member, ':')
		if i < 1 {
			return nil, false
		}
		var n int
		if _, err := fmt.Sscanf(member[:i], "%d", &n); err != nil || n < 0 || i+1+n > len(member) {
			return nil, false
		}
		parts = append(parts, member[i+1:i+1+n])
		member = member[i+1+n:]
	}
	return parts, true
}
