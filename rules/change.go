package rules

import (
	"fmt"
	"reflect"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A rules file changes while the fleet runs (worker.Middleware.Reload, on
// SIGHUP in cmd/worker). Its limits keep their state in Redis under
// <prefix>{<subject>}:<limit name>, whatever the limit's numbers, so a new
// count, period, burst, precision or lease applies to the next request and
// every booking already made stays. CheckChange refuses the changes whose
// limits could not read the state they find, and a new prefix.

// Diff is what changed from one rules file to the next, by rule name.
type Diff struct {
	Added   []string // rules only in the new file, in its order
	Removed []string // rules only in the old file, in its order
	// Changed are the rules of both files that differ in anything but
	// their line: tasks, subject, cost, limits (a budget's included),
	// max_wait, wait_slots, horizon, fair_by, weights or share_limit. In
	// the new file's order.
	Changed  []string
	FailOpen bool // fail_open changed
}

// Diff returns what changed from c to next.
func (c *Config) Diff(next *Config) Diff {
	var d Diff
	for _, r := range next.Rules {
		old, ok := c.Rule(r.Name)
		switch {
		case !ok:
			d.Added = append(d.Added, r.Name)
		case !sameRule(old, r):
			d.Changed = append(d.Changed, r.Name)
		}
	}
	for _, r := range c.Rules {
		if _, ok := next.Rule(r.Name); !ok {
			d.Removed = append(d.Removed, r.Name)
		}
	}
	d.FailOpen = c.FailOpen != next.FailOpen
	return d
}

// sameRule reports whether a and b are the same rule, wherever they stand
// in their files.
func sameRule(a, b RuleConfig) bool {
	a.Line, b.Line = 0, 0
	return reflect.DeepEqual(a, b)
}

// CheckChange returns a *Error if next cannot replace c while the keys of
// c's limits live in Redis (a running fleet, or one restarted within the
// limits' periods), and nil if it can:
//
//   - another prefix: every key moves, and the bookings made under c are
//     lost; that needs a restart of every worker and producer at once;
//   - a limit (a rule's, a policy's or a budget, by name) whose algorithm
//     changes, except between token_bucket and gcra, which keep the same
//     state: the new algorithm cannot read the old one's (a sorted set
//     where a string was, say);
//   - a fixed_window limit whose period changes: its state counts
//     windows of the old period, and a longer one would book turns
//     centuries ahead;
//   - a calendar limit whose calendar changes (unit, first weekday or
//     zone): a window that starts later than the counted one would start
//     from zero, admitting the day's quota twice.
//
// Either limit change is made by giving the limit a new name: its keys
// then start empty, and the old ones expire.
func (c *Config) CheckChange(next *Config) error {
	if c.Prefix != next.Prefix {
		return &Error{File: next.File, Field: "prefix", Reason: fmt.Sprintf("%q was %q: a new prefix moves every key and loses the bookings made under the old one; restart the fleet to change it", next.Prefix, c.Prefix)}
	}
	old := map[string]throttle.Rule{}
	for _, r := range c.Rules {
		for _, l := range r.Limits {
			old[l.Name] = l
		}
	}
	for _, r := range next.Rules {
		for _, l := range r.Limits {
			prev, ok := old[l.Name]
			if !ok {
				continue
			}
			fail := func(field, reason string) error {
				if l.Name != r.Name {
					reason = fmt.Sprintf("limit %q: %s", l.Name, reason)
				}
				return &Error{File: next.File, Line: r.Line, Kind: "rule", Name: r.Name, Field: field,
					Reason: reason + "; give the limit a new name to change it (its keys then start empty)"}
			}
			switch {
			case prev.Algorithm != l.Algorithm && !(prev.Algorithm.Bucket() && l.Algorithm.Bucket()):
				return fail("algorithm", fmt.Sprintf("%s was %s: the state of the old algorithm in Redis cannot be read by the new one", l.Algorithm, prev.Algorithm))
			case l.Algorithm == throttle.FixedWindow && prev.Limit.Period != l.Limit.Period:
				return fail("period", fmt.Sprintf("%v was %v: a fixed window's state in Redis counts windows of its period", l.Limit.Period, prev.Limit.Period))
			case l.Algorithm == throttle.CalendarWindow && prev.Calendar != l.Calendar:
				return fail("period", fmt.Sprintf("%v was %v: a calendar quota's count in Redis is of the old calendar's window, and a new one would start from zero", l.Calendar, prev.Calendar))
			}
		}
	}
	return nil
}
