package rules

import (
	"fmt"
	"slices"
	"strings"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// aliases are the other spellings of algorithms that ParseAlgorithm
// accepts; those shown are named in messages beside their algorithm.
var aliases = []struct {
	name  string
	a     throttle.Algorithm
	shown bool
}{
	{"leaky_bucket", throttle.GCRA, true},
	{"sliding_window_counter", throttle.SlidingWindow, false},
}

// ParseAlgorithm reads an algorithm as rules files and command lines spell
// it: its name (throttle.Algorithms), or leaky_bucket for gcra and
// sliding_window_counter for sliding_window, in any case, with dashes or
// underscores.
func ParseAlgorithm(s string) (throttle.Algorithm, error) {
	norm := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(s)), "-", "_")
	for _, al := range aliases {
		if norm == al.name {
			return al.a, nil
		}
	}
	if a := throttle.Algorithm(norm); slices.Contains(throttle.Algorithms(), a) {
		return a, nil
	}
	return "", fmt.Errorf("unknown algorithm %q: use %s", s, AlgorithmNames(throttle.Algorithms()))
}

// PaceAlgorithms are the algorithms a producer paces with (enqueue's
// inline rule), as its messages list them: gcra, the default, first; the
// other buckets; then the windows. Concurrency limits running tasks, not a
// rate, and paces nothing; a calendar quota needs a calendar, which an
// inline rule (a rate) has no place for.
func PaceAlgorithms() []throttle.Algorithm {
	as := []throttle.Algorithm{throttle.GCRA}
	for _, bucket := range []bool{true, false} {
		for _, a := range throttle.Algorithms() {
			if a.Bucket() == bucket && a != throttle.GCRA && a != throttle.Concurrency && a != throttle.CalendarWindow {
				as = append(as, a)
			}
		}
	}
	return as
}

// AlgorithmNames lists as for messages, each with its alias: "gcra
// (leaky_bucket), token_bucket, … or sliding_window".
func AlgorithmNames(as []throttle.Algorithm) string {
	return listAlgorithms(as, " (%s)", " or ")
}

// listAlgorithms names as, each followed by its shown alias written with
// aliasFormat (nothing if ""), joined by ", " and, before the last, by
// last.
func listAlgorithms(as []throttle.Algorithm, aliasFormat, last string) string {
	names := make([]string, len(as))
	for i, a := range as {
		names[i] = string(a)
		for _, al := range aliases {
			if al.a == a && al.shown && aliasFormat != "" {
				names[i] += fmt.Sprintf(aliasFormat, al.name)
			}
		}
	}
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + last + names[len(names)-1]
}
