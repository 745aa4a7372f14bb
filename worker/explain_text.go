package worker

import (
	"fmt"
	"strings"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
)

// Text is the explanation in a few lines for a person: where the task is,
// the rule and subject that hold it and until when, and asynq's view of
// it. Times are UTC, each with how far it is from Now (Redis clock).
func (e *Explanation) Text() string {
	var b strings.Builder
	b.WriteString(e.headline() + "\n")
	line := func(format string, args ...any) { fmt.Fprintf(&b, "  "+format+"\n", args...) }
	if e.Asked != "" {
		line("asked for %s: it was parked as this copy (no retry was left)", e.Asked)
	}
	for _, s := range e.ruleLines() {
		line("%s", s)
	}
	if e.Wakeup != nil && !e.wakesAtTurn() {
		line("wake-up due at %s: the wake-up loop moves it to pending just before then", e.at(*e.Wakeup))
	}
	line("%s", e.asynqLine())
	switch {
	case e.LastWait != nil:
		line("%s", e.lastWaitLine())
	case e.LastError != "" && e.LastErrorAt != nil:
		line("last error at %s: %s", e.at(*e.LastErrorAt), e.LastError)
	case e.LastError != "":
		line("last error: %s", e.LastError)
	}
	if e.EnqueuedAt != nil {
		line("enqueued at %s", e.at(*e.EnqueuedAt))
	}
	if e.Requeues > 0 {
		line("parked as a copy %d times (each time it had no retry left)", e.Requeues)
	}
	return b.String()
}

// headline is the first line: the task and where it is.
func (e *Explanation) headline() string {
	task := fmt.Sprintf("task %s (%s)", e.TaskID, e.Type)
	q := fmt.Sprintf("%q", e.Queue)
	switch e.Status {
	case StatusRunning:
		if e.Orphaned {
			return fmt.Sprintf("%s is active in queue %s but orphaned: its worker stopped renewing its lease, and asynq gives it back to the queue", task, q)
		}
		s := fmt.Sprintf("%s is running in queue %s", task, q)
		if r := e.Running; r != nil {
			s += fmt.Sprintf(", on %s (pid %d) since %s", r.Host, r.PID, e.at(r.Started))
		}
		return s
	case StatusPending:
		return fmt.Sprintf("%s is pending in queue %s: it runs when a worker is free", task, q)
	case StatusParked:
		return fmt.Sprintf("%s is parked in queue %s: waiting for its turn, not failed", task, q)
	case StatusScheduled:
		return fmt.Sprintf("%s is scheduled in queue %s", task, q)
	case StatusRetrying:
		return fmt.Sprintf("%s failed and waits in queue %s for its retry", task, q)
	case StatusArchived:
		return fmt.Sprintf("%s is archived in queue %s: it does not run again unless run by hand", task, q)
	case StatusCompleted:
		s := fmt.Sprintf("%s completed in queue %s", task, q)
		if e.CompletedAt != nil {
			s += " at " + e.at(*e.CompletedAt)
		}
		return s
	}
	return fmt.Sprintf("%s is %s in queue %s", task, e.State, q)
}

// ruleLines say which rule applies and what it keeps for the task.
func (e *Explanation) ruleLines() []string {
	r := e.Rule
	switch {
	case !e.RulesKnown && e.LastWait != nil:
		return []string{fmt.Sprintf("rule: unknown without the rules file (--config); it last waited under rule %q", e.LastWait.Rule)}
	case !e.RulesKnown:
		return []string{"rule: unknown without the rules file (--config)"}
	case r == nil:
		return []string{fmt.Sprintf("no rule applies to type %q", e.Type)}
	case r.SubjectError != "":
		return []string{fmt.Sprintf("rule %q, but no subject: %s (it is archived when it runs)", r.Name, r.SubjectError)}
	}
	lines := []string{fmt.Sprintf("rule %q (limits %s), subject %q", r.Name, strings.Join(r.Limits, ", "), r.Subject)}
	switch {
	case r.Priority != nil:
		lines = append(lines, fmt.Sprintf("priority %d of 0-%d (higher first); after %v in line it goes before every task that joined after it",
			*r.Priority, admission.MaxPriority, time.Duration(r.MaxAgeSeconds*float64(time.Second))))
	case r.PriorityError != "":
		lines = append(lines, fmt.Sprintf("no priority: %s (it is archived when it runs)", r.PriorityError))
	}
	if r.NoBookings != "" {
		return append(lines, r.NoBookings)
	}
	lines = append(lines, e.bookingLines()...)
	if e.Status == StatusParked && len(lines) == 1 {
		lines = append(lines, "nothing booked for it now: it asks for a new turn when asynq brings it back")
	}
	return lines
}

// bookingLines say what the rule's limiter keeps for the task: its turn,
// its producer's receipt, its position in its subject's line or in the
// queue for a place of a concurrency limit.
func (e *Explanation) bookingLines() []string {
	r := e.Rule
	var lines []string
	switch {
	case r.Turn != nil && r.TurnPaid:
		lines = append(lines, fmt.Sprintf("its turn came at %s and is paid; it waits for a place of concurrency limit %q", e.at(*r.Turn), r.Concurrency))
	case r.Turn != nil && e.wakesAtTurn():
		lines = append(lines, fmt.Sprintf("turn booked for %s; the wake-up loop moves it to pending just before", e.at(*r.Turn)))
	case r.Turn != nil:
		lines = append(lines, fmt.Sprintf("turn booked for %s", e.at(*r.Turn)))
	}
	if r.Receipt != nil {
		lines = append(lines, fmt.Sprintf("paced by its producer: turn booked for %s", e.at(*r.Receipt)))
	}
	if r.InLine {
		s := fmt.Sprintf("waiting in its subject's line, no turn booked yet: position %d of %d", r.Position, r.LineLength)
		if r.LineServing != nil {
			s += fmt.Sprintf("; the line is next served at %s", e.at(*r.LineServing))
		}
		lines = append(lines, s)
	}
	switch {
	case r.Holding:
		lines = append(lines, fmt.Sprintf("holds a place of concurrency limit %q", r.Concurrency))
	case r.QueuedForPlace > 0:
		lines = append(lines, fmt.Sprintf("queued for a place of concurrency limit %q: position %d", r.Concurrency, r.QueuedForPlace))
	}
	return lines
}

// wakesAtTurn reports that the task's wake-up is due at its booked turn.
func (e *Explanation) wakesAtTurn() bool {
	return e.Wakeup != nil && e.Rule != nil && e.Rule.Turn != nil && !e.Rule.TurnPaid && e.Rule.Turn.Equal(*e.Wakeup)
}

// lastWaitLine says what the task last waited for: for a parked task, the
// park it is in (whose turn the lines above give), else an earlier one.
func (e *Explanation) lastWaitLine() string {
	w := e.LastWait
	s := "last parked"
	if e.LastErrorAt != nil {
		s += " at " + e.at(*e.LastErrorAt)
	}
	s += fmt.Sprintf(" by rule %q, subject %q", w.Rule, w.Subject)
	if e.Status != StatusParked {
		s += ", until " + e.at(w.RunsAgainAt)
	}
	if w.Requeued != "" {
		s += ", requeued as " + w.Requeued
	}
	if w.Cause != "" {
		s += ": " + w.Cause
	}
	return s
}

// asynqLine is asynq's view: state, next time, retries.
func (e *Explanation) asynqLine() string {
	s := "asynq: " + e.State
	switch {
	case e.NextProcessAt != nil && e.Rule != nil && e.Rule.InLine:
		s += ", back in its queue by itself at " + e.at(*e.NextProcessAt) + " if its line's serving has not woken it"
	case e.NextProcessAt != nil:
		s += ", back in its queue at " + e.at(*e.NextProcessAt)
	}
	s += fmt.Sprintf(", retried %d of %d", e.Retried, e.MaxRetry)
	if e.Status == StatusParked || e.LastWait != nil {
		s += " (parks are not counted: they are not failures)"
	}
	return s
}

// at writes t with how far it is from Now: "2026-05-06T07:08:09.300Z (in 2.5s)".
func (e *Explanation) at(t time.Time) string {
	d := t.Sub(e.Now)
	r := time.Second
	if d > -time.Minute && d < time.Minute {
		r = 100 * time.Millisecond
	}
	when := "now"
	switch d = d.Round(r); {
	case d > 0:
		when = "in " + d.String()
	case d < 0:
		when = (-d).String() + " ago"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z") + " (" + when + ")"
}
