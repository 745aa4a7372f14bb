package enqueue

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Plan is what a batch will do, found before its first task is enqueued
// (Batch.Plan): how many tasks and, if paced, how far ahead it books.
type Plan struct {
	Tasks int
	Paced bool

	// The rest is for a paced batch only.

	// Subjects is how many subjects its tasks are booked under.
	Subjects int
	// Subject is the one with the most permits to book, the last to be
	// done, and Permits those permits (a task's cost; 1 each by default).
	Subject string
	Permits int64
	// Rule is the rule that paces Subject's permits the slowest, and Limit
	// its limit.
	Rule  string
	Limit throttle.Limit
	// Booked is how far ahead of now Subject's ledger held bookings
	// already (the rules' ResetAfter, read without charging): the batch's
	// slots come after them.
	Booked time.Duration
	// Ahead estimates how far ahead of now the batch books its last slot:
	// Booked, plus the time Limit takes for Permits beyond what it admits
	// at once. It is exact for one gcra or token_bucket rule and costs of
	// 1; a window's slots come at its boundaries, so its last may be up to
	// one period later.
	Ahead time.Duration
}

// Plan checks the batch as Validate does and, for a paced batch, reads
// how far ahead its busiest subject is booked (one Redis call, charging
// nothing) and estimates how far ahead its last slot will be. Run makes
// the plan itself before its first task; call Plan to show it without
// running.
func (b *Batch) Plan(ctx context.Context) (Plan, error) {
	if err := b.validateShape(); err != nil {
		return Plan{}, err
	}
	p := Plan{Tasks: b.size(), Paced: b.Pacer != nil}
	if b.Pacer == nil {
		return p, nil
	}
	t, err := b.scan()
	if err != nil {
		return Plan{}, err
	}
	p.Subjects, p.Subject, p.Permits = t.subjects, t.busiest, t.permits
	if p.Permits == 0 {
		return p, nil // every task costs 0: none is booked
	}
	lim := b.Pacer.Limiter
	rules := lim.Rules()
	if !holdsPlaces(rules) { // a concurrency rule has no state to read
		res, err := lim.AllowN(ctx, p.Subject, 0)
		if err != nil {
			return Plan{}, fmt.Errorf("enqueue: reading how far ahead subject %q is booked: %w", p.Subject, err)
		}
		p.Booked = res.ResetAfter
	}
	p.Ahead = p.Booked
	for _, r := range rules {
		if r.Algorithm == throttle.Concurrency {
			continue
		}
		if ahead := p.Booked + span(r, p.Permits); p.Rule == "" || ahead > p.Ahead {
			p.Rule, p.Limit, p.Ahead = r.Name, r.Limit, ahead
		}
	}
	p.Ahead = max(p.Ahead, 0)
	return p, nil
}

// span is how much later than its first permit rule r grants the last of
// permits, at its steady rate after what it admits at once: negative if
// they fit in that, which then also absorbs part of what is booked.
func span(r throttle.Rule, permits int64) time.Duration {
	extra := float64(permits - int64(r.Capacity()))
	d := extra * float64(r.Limit.Period) / float64(r.Limit.Count)
	return time.Duration(min(d, float64(math.MaxInt64/2)))
}

// holdsPlaces reports whether rules has a Concurrency rule.
func holdsPlaces(rules []throttle.Rule) bool {
	for _, r := range rules {
		if r.Algorithm == throttle.Concurrency {
			return true
		}
	}
	return false
}

// tally is what a paced batch books, found by scan.
type tally struct {
	subjects int    // distinct subjects
	busiest  string // the subject with the most permits
	permits  int64  // busiest's
}

// scan derives every task's subject and permits as the Pacer will book
// them, before any is: the first that would fail is a *PayloadError.
func (b *Batch) scan() (tally, error) {
	n := b.size()
	if len(b.Payloads) <= 1 { // every task has the same payload
		subject, cost, err := b.Pacer.terms(b.payload(0))
		if err != nil {
			return tally{}, b.payloadError(0, err)
		}
		return tally{subjects: 1, busiest: subject, permits: int64(cost) * int64(n)}, nil
	}
	sums := map[string]int64{}
	var t tally
	for i := range n {
		subject, cost, err := b.Pacer.terms(b.Payloads[i])
		if err != nil {
			return tally{}, b.payloadError(i, err)
		}
		sums[subject] += int64(cost)
		if s := sums[subject]; s > t.permits || t.busiest == "" {
			t.busiest, t.permits = subject, s
		}
	}
	t.subjects = len(sums)
	return t, nil
}

// payloadError names payload i of the batch.
func (b *Batch) payloadError(i int, err error) *PayloadError {
	e := &PayloadError{Index: i, Err: err}
	switch {
	case len(b.Payloads) <= 1:
		e.Where = "the payload"
	case b.Where != nil:
		e.Where = b.Where(i)
	default:
		e.Where = fmt.Sprintf("payload %d", i+1)
	}
	return e
}

// PayloadError is a task of a paced batch that could not be booked: its
// subject or cost cannot be derived from its payload, or its rule refuses
// it whatever the ledger holds (an invalid subject, a cost above what the
// rule admits at once). Validate, Plan and Run report it before the first
// task is enqueued.
type PayloadError struct {
	Index int    // the task's 0-based position in the batch
	Where string // "accounts.jsonl:12" (Batch.Where), "payload 3" or "the payload"
	Err   error
}

func (e *PayloadError) Error() string {
	return fmt.Sprintf("enqueue: %s: %v; fix it and run the batch again (nothing was enqueued)", e.Where, e.Err)
}

func (e *PayloadError) Unwrap() error { return e.Err }

// AheadError refuses a paced batch whose last slot would be booked further
// ahead than its Batch.MaxAhead. Nothing was booked or enqueued.
type AheadError struct {
	Plan     Plan
	MaxAhead time.Duration
}

func (e *AheadError) Error() string {
	return fmt.Sprintf("enqueue: %s, more than the %v allowed; split the batch, or allow it to book further ahead",
		e.Plan.Describe(), e.MaxAhead)
}

// Describe says what a paced plan books, such as "pacing 5000 tasks at
// 20/s (rule api): the last is booked 4m10s ahead".
func (p Plan) Describe() string {
	if !p.Paced {
		return fmt.Sprintf("%d tasks, due at once", p.Tasks)
	}
	if p.Permits == 0 {
		return fmt.Sprintf("%d tasks of cost 0, due at once", p.Tasks)
	}
	rate := ""
	if p.Rule != "" {
		rate = fmt.Sprintf(" at %s (rule %s)", FormatRate(p.Limit), p.Rule)
	}
	what := fmt.Sprintf("pacing %d tasks%s", p.Tasks, rate)
	if p.Subjects > 1 {
		what = fmt.Sprintf("pacing %d tasks over %d subjects%s", p.Tasks, p.Subjects, rate)
	}
	last := "the last"
	if p.Subjects > 1 {
		last = fmt.Sprintf("the last of the busiest, %q (%d permits),", p.Subject, p.Permits)
	}
	booked := ""
	if p.Booked > 0 {
		booked = fmt.Sprintf(", after bookings up to %s ahead", RoundAhead(p.Booked))
	}
	return fmt.Sprintf("%s: %s is booked about %s ahead%s", what, last, RoundAhead(p.Ahead), booked)
}

// FormatRate writes l as ParseRate reads it: "20/s", "100/m", "3/500ms".
func FormatRate(l throttle.Limit) string {
	switch l.Period {
	case time.Second:
		return fmt.Sprintf("%d/s", l.Count)
	case time.Minute:
		return fmt.Sprintf("%d/m", l.Count)
	case time.Hour:
		return fmt.Sprintf("%d/h", l.Count)
	case 24 * time.Hour:
		return fmt.Sprintf("%d/d", l.Count)
	}
	return fmt.Sprintf("%d/%v", l.Count, l.Period)
}

// RoundAhead rounds d for messages: to the millisecond under a minute, to
// the second under an hour, else to the minute, with the days beside it
// from two days on ("2777h47m (115.7 days)").
func RoundAhead(d time.Duration) string {
	switch {
	case d < time.Minute:
		return d.Round(time.Millisecond).String()
	case d < time.Hour:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return trimZeroSeconds(d.Round(time.Minute))
	}
	return fmt.Sprintf("%s (%.1f days)", trimZeroSeconds(d.Round(time.Minute)), d.Hours()/24)
}

// trimZeroSeconds writes a whole number of minutes without "0s".
func trimZeroSeconds(d time.Duration) string {
	s := d.String()
	if len(s) > 2 && s[len(s)-2:] == "0s" && s[len(s)-3] == 'm' {
		return s[:len(s)-2]
	}
	return s
}
