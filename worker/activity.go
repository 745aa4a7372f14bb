package worker

import (
	"maps"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
)

// ActivitySpan is how far back an Activity keeps its counts per second;
// ActivityAhead how far ahead it spreads the turns booked, per second.
const (
	ActivitySpan  = 5 * time.Minute
	ActivityAhead = time.Minute
)

// Activity is what a middleware did lately, rule by rule, kept in memory
// for a status page (cmd/worker serves one): the tasks admitted and parked
// in each of the last ActivitySpan seconds, the decisions by outcome since
// the Metrics were created, and the turns booked for parked tasks that
// have not come yet. It belongs to Metrics (Metrics.Activity) and is fed
// by the same calls, so its counts are those of
// jobthrottle_decisions_total and its turns those of
// jobthrottle_booked_turns. Recording takes a mutex and no Redis call; it
// keeps a fixed ring of seconds per rule. Safe for concurrent use.
type Activity struct {
	turns *turnBook // the Metrics' turns ahead
	lines *lineBook // the Metrics' lines' lengths

	mu    sync.Mutex
	rules map[string]*ruleActivity
}

// ruleActivity is one rule's record.
type ruleActivity struct {
	decisions map[string]int64
	seconds   [activitySeconds]secondCount // a ring, by Unix second
}

// activitySeconds is the ring's length: ActivitySpan in seconds.
const activitySeconds = int(ActivitySpan / time.Second)

// secondCount is one second of a rule's ring; a slot whose unix is not
// the second asked for counts nothing.
type secondCount struct {
	unix             int64
	admitted, parked int
}

// RuleActivity is one rule's record in an Activity.
type RuleActivity struct {
	// Rule is the rule's name.
	Rule string
	// Decisions counts the rule's tasks by outcome (admission's Label
	// constants) since the Metrics were created, as
	// jobthrottle_decisions_total does; an outcome never seen is absent.
	Decisions map[string]int64
	// Seconds are the last ActivitySpan seconds, oldest first; the last
	// is the current second, still counting.
	Seconds []SecondActivity
	// Ahead are the next ActivityAhead seconds, the current one first:
	// in each, Parked counts the turns booked ahead that are due in it
	// (Admitted is zero).
	Ahead []SecondActivity
	// TurnsAhead counts the turns this process booked for parked tasks
	// that have not come yet (to within 0.1 s), however far ahead, as
	// jobthrottle_booked_turns does: booked when they parked, or when it
	// served their subject's line.
	TurnsAhead int
	// NextTurn and LastTurn are the soonest and the furthest of those
	// turns (local clock; the soonest to within 0.1 s); zero if none.
	NextTurn, LastTurn time.Time
	// LineWaiting counts the tasks waiting in the lines of the rule's
	// subjects that this process serves, with no turn yet, as its last
	// serving of each line counted them: jobthrottle_line_waiting.
	LineWaiting int
}

// SecondActivity is one second of a rule's activity.
type SecondActivity struct {
	// Start is when the second began (local clock).
	Start time.Time
	// Admitted counts the tasks admitted in it: at once, after a wait, or
	// on a turn booked before.
	Admitted int
	// Parked counts the tasks parked in it or, in RuleActivity.Ahead, the
	// turns due in it.
	Parked int
}

// Admitted counts the rule's tasks admitted since the Metrics were
// created: at once, after waiting, or on a turn booked before.
func (r RuleActivity) Admitted() int64 {
	return r.Decisions[admission.LabelAdmitted] + r.Decisions[admission.LabelWaited] + r.Decisions[admission.LabelRedeemed]
}

// Activity returns the record of the middleware's recent decisions that
// these Metrics keep beside their Prometheus series; nil for nil Metrics.
func (m *Metrics) Activity() *Activity {
	if m == nil {
		return nil
	}
	return m.activity
}

// rule returns rule's record, created if new; a holds its mutex.
func (a *Activity) rule(name string) *ruleActivity {
	if a.rules == nil {
		a.rules = map[string]*ruleActivity{}
	}
	r := a.rules[name]
	if r == nil {
		r = &ruleActivity{decisions: map[string]int64{}}
		a.rules[name] = r
	}
	return r
}

// decided counts a decision for a task of rule.
func (a *Activity) decided(rule, outcome string) {
	now := time.Now().Unix()
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.rule(rule)
	r.decisions[outcome]++
	s := &r.seconds[now%int64(activitySeconds)]
	if s.unix != now {
		*s = secondCount{unix: now}
	}
	switch outcome {
	case admission.LabelAdmitted, admission.LabelWaited, admission.LabelRedeemed:
		s.admitted++
	case admission.LabelParked:
		s.parked++
	}
}

// Rule returns the record of the rule named name now: every count zero
// for a rule nothing was decided for yet, and for a nil Activity.
func (a *Activity) Rule(name string) RuleActivity {
	now := time.Now()
	ra := RuleActivity{Rule: name, Seconds: make([]SecondActivity, activitySeconds), Ahead: make([]SecondActivity, ActivityAhead/time.Second)}
	sec := now.Unix()
	for i := range ra.Seconds {
		ra.Seconds[i].Start = time.Unix(sec-int64(activitySeconds-1-i), 0)
	}
	for i := range ra.Ahead {
		ra.Ahead[i].Start = time.Unix(sec+int64(i), 0)
	}
	if a == nil {
		return ra
	}
	a.mu.Lock()
	if r := a.rules[name]; r != nil {
		ra.Decisions = maps.Clone(r.decisions)
		for i := range ra.Seconds {
			s := ra.Seconds[i].Start.Unix()
			if c := r.seconds[s%int64(activitySeconds)]; c.unix == s {
				ra.Seconds[i].Admitted, ra.Seconds[i].Parked = c.admitted, c.parked
			}
		}
	}
	a.mu.Unlock()
	grains, furthest := a.turns.ahead(name, now)
	for at, n := range grains {
		ra.TurnsAhead += n
		if i := int(at.Unix() - sec); i < len(ra.Ahead) {
			ra.Ahead[i].Parked += n
		}
		if ra.NextTurn.IsZero() || at.Before(ra.NextTurn) {
			ra.NextTurn = at
		}
	}
	if ra.TurnsAhead > 0 {
		ra.LastTurn = furthest
	}
	ra.LineWaiting = a.lines.waiting(name)
	return ra
}
