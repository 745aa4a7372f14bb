package worker

import (
	"maps"
	"sync"
	"time"
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
// have not come yet. It is fed by the same calls as the Metrics it belongs
// to (Metrics.Activity), so its counts are those of
// jobthrottle_decisions_total. Recording takes a mutex and no Redis call;
// it keeps a fixed ring of seconds per rule, and the booked turns ahead
// by second. Safe for concurrent use.
type Activity struct {
	mu    sync.Mutex
	rules map[string]*ruleActivity
}

// ruleActivity is one rule's record.
type ruleActivity struct {
	decisions map[string]int64
	seconds   [activitySeconds]secondCount // a ring, by Unix second
	turns     map[int64]int                // turns booked ahead, by the Unix second they are due in
	inLine    int64
	pruned    int64 // the Unix second turns was last pruned in
}

// activitySeconds is the ring's length: ActivitySpan in seconds.
const activitySeconds = int(ActivitySpan / time.Second)

// secondCount is one second of a rule's ring; a slot whose unix is not
// the second asked for counts nothing.
type secondCount struct {
	unix             int64
	admitted, parked int
}

// RuleActivity is one rule's record in an Activity snapshot.
type RuleActivity struct {
	// Rule is the rule's name.
	Rule string
	// Decisions counts the rule's tasks by outcome (the Outcome
	// constants) since the Metrics were created, as
	// jobthrottle_decisions_total does; an outcome never seen is absent.
	Decisions map[string]int64
	// Seconds are the last ActivitySpan seconds, oldest first; the last
	// is the current second, still counting.
	Seconds []SecondActivity
	// Ahead are the next ActivityAhead seconds, the current one first:
	// in each, Parked counts the turns booked by this process that are due
	// in it (Admitted is zero).
	Ahead []SecondActivity
	// TurnsAhead counts the turns this process booked for parked tasks
	// that are not due yet (to the second), however far ahead: when they
	// parked, or when it served their subject's line. (A task that comes
	// back before its turn and parks on it again counts it again.)
	TurnsAhead int
	// NextTurn and LastTurn are the seconds the soonest and the furthest
	// of those turns are due in (the local clock, truncated to the
	// second); zero if there is none.
	NextTurn, LastTurn time.Time
	// InLine counts the tasks parked in their subject's line, with no turn
	// booked (the line books it later), since the Metrics were created.
	InLine int64
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
	return r.Decisions[OutcomeAdmitted] + r.Decisions[OutcomeWaited] + r.Decisions[OutcomeRedeemed]
}

// Activity returns the record of the middleware's recent decisions that
// these Metrics keep beside their Prometheus series; nil for nil Metrics.
func (m *Metrics) Activity() *Activity {
	if m == nil {
		return nil
	}
	return m.activity
}

// parkedTurn records a park of rule on a turn due after ahead, or, for a
// zero turn, in its subject's line.
func (m *Metrics) parkedTurn(rule string, turn time.Time, ahead time.Duration) {
	if m != nil {
		m.activity.parkedTurn(rule, turn, ahead)
	}
}

// handedTurns records the turns a serving of rule's line booked for the
// tasks waiting in it, by task, each with its slot on the Redis clock
// (taken as the local one, as the wake-ups take it).
func (m *Metrics) handedTurns(rule string, handed map[string]time.Time) {
	if m == nil || len(handed) == 0 {
		return
	}
	aheads := make([]time.Duration, 0, len(handed))
	for _, slot := range handed {
		aheads = append(aheads, time.Until(slot))
	}
	m.activity.turnsAhead(rule, aheads...)
}

// rule returns rule's record, created if new; a holds its mutex.
func (a *Activity) rule(name string) *ruleActivity {
	if a.rules == nil {
		a.rules = map[string]*ruleActivity{}
	}
	r := a.rules[name]
	if r == nil {
		r = &ruleActivity{decisions: map[string]int64{}, turns: map[int64]int{}}
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
	case OutcomeAdmitted, OutcomeWaited, OutcomeRedeemed:
		s.admitted++
	case OutcomeParked:
		s.parked++
	}
}

// parkedTurn records a park of rule on a turn due after ahead (turn is
// not zero), or in the subject's line.
func (a *Activity) parkedTurn(rule string, turn time.Time, ahead time.Duration) {
	if turn.IsZero() {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.rule(rule).inLine++
		return
	}
	a.turnsAhead(rule, ahead)
}

// turnsAhead records turns of rule booked for parked tasks, due after
// each of aheads. The turns that have come are dropped at most once a
// second, so a process nobody looks at keeps only the seconds booked
// ahead.
func (a *Activity) turnsAhead(rule string, aheads ...time.Duration) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.rule(rule)
	if r.pruned != now.Unix() {
		r.prune(now.Unix())
	}
	for _, ahead := range aheads {
		r.turns[now.Add(ahead).Unix()]++
	}
}

// prune drops the turns due before the second now.
func (r *ruleActivity) prune(now int64) {
	r.pruned = now
	maps.DeleteFunc(r.turns, func(sec int64, _ int) bool { return sec < now })
}

// Rule returns the record of the rule named name now: every count zero
// for a rule nothing was decided for yet, and for a nil Activity.
func (a *Activity) Rule(name string) RuleActivity {
	now := time.Now().Unix()
	if a == nil {
		return (&ruleActivity{}).snapshot(name, now)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	r := a.rules[name]
	if r == nil {
		r = &ruleActivity{}
	}
	return r.snapshot(name, now)
}

// snapshot is r's record at the Unix second now.
func (r *ruleActivity) snapshot(name string, now int64) RuleActivity {
	r.prune(now)
	ra := RuleActivity{Rule: name, Decisions: maps.Clone(r.decisions), InLine: r.inLine,
		Seconds: make([]SecondActivity, activitySeconds), Ahead: make([]SecondActivity, ActivityAhead/time.Second)}
	for i := range ra.Seconds {
		sec := now - int64(activitySeconds-1-i)
		ra.Seconds[i].Start = time.Unix(sec, 0)
		if s := r.seconds[sec%int64(activitySeconds)]; s.unix == sec {
			ra.Seconds[i].Admitted, ra.Seconds[i].Parked = s.admitted, s.parked
		}
	}
	for i := range ra.Ahead {
		ra.Ahead[i].Start = time.Unix(now+int64(i), 0)
	}
	for sec, n := range r.turns {
		ra.TurnsAhead += n
		if i := sec - now; i < int64(len(ra.Ahead)) {
			ra.Ahead[i].Parked += n
		}
		if t := time.Unix(sec, 0); ra.NextTurn.IsZero() || t.Before(ra.NextTurn) {
			ra.NextTurn = t
		}
		if t := time.Unix(sec, 0); t.After(ra.LastTurn) {
			ra.LastTurn = t
		}
	}
	return ra
}
