package throttle

import (
	"fmt"
	"time"
)

// Limit is a rate: Count permits per Period, with bursts of up to Burst
// permits at one instant. Burst matters to the token bucket and the leaky
// bucket; the window algorithms admit Count per Period and ignore it.
//
// Build one with PerSecond, or as a literal for other periods (Limit{Count: 1000, Period: 24 * time.Hour, Burst: 1000}), and
// adjust the burst with WithBurst. A Limit is checked when a Limiter is
// built.
type Limit struct {
	Count  int           // permits per Period; at least 1
	Period time.Duration // at least 1µs, at most maxPeriod
	Burst  int           // bucket capacity; at least 1 (for the bucket algorithms)
}

// Bounds on a Limit, chosen so that every time a script computes stays an
// exact integer number of microseconds in a Lua double (below 2^53).
const (
	// maxPeriod is the longest Period (and the longest burst horizon,
	// Burst × Period / Count) a Limit may have.
	maxPeriod = 10 * 365 * 24 * time.Hour
	// maxCount bounds Count and Burst (MaxPermits).
	maxCount = MaxPermits
	// maxLogCount bounds Count for SlidingLog, which stores one sorted-set
	// member per permit; use SlidingWindow for larger counts.
	maxLogCount = 1_000_000
	// maxBuckets bounds Period / Precision for SlidingWindow, which stores
	// one hash field per bucket.
	maxBuckets = 10_000
)

// MaxPermits bounds a Limit's Count and Burst, 2^40: Rule.Validate
// refuses more. Rules files and command lines that read a limit check
// against it, so that the bound is stated once.
const MaxPermits = 1 << 40

// PerSecond returns a limit of n permits per second, burst n.
func PerSecond(n int) Limit { return Limit{Count: n, Period: time.Second, Burst: n} }

// WithBurst returns a copy of l whose Burst is b.
func (l Limit) WithBurst(b int) Limit { l.Burst = b; return l }

// interval is the time between two permits at the steady rate: Period / Count.
func (l Limit) interval() time.Duration {
	if l.Count <= 0 {
		return 0
	}
	return l.Period / time.Duration(l.Count)
}

// describe describes the limit for messages, such as "20 per 1s (burst 20)".
func (l Limit) describe() string {
	return fmt.Sprintf("%d per %v (burst %d)", l.Count, l.Period, l.Burst)
}

// validate reports the first invalid field that every limit checks.
func (l Limit) validate() error {
	switch {
	case l.Count < 1:
		return fieldError("count", l.Count, "must be at least 1")
	case l.Count > maxCount:
		return fieldError("count", l.Count, fmt.Sprintf("must be at most %d", maxCount))
	case l.Period < time.Microsecond:
		return fieldError("period", l.Period, "must be at least 1µs")
	case l.Period > maxPeriod:
		return fieldError("period", l.Period, fmt.Sprintf("must be at most %v", maxPeriod))
	}
	return nil
}

// capacity is the largest request l can ever admit under algorithm a.
func (l Limit) capacity(a Algorithm) int {
	if s := a.spec(); s != nil && s.holders {
		return maxCount // a holder takes one place, whatever its n
	}
	if a.bucket() {
		return l.Burst
	}
	return l.Count
}

// Algorithm selects how a rule counts permits. Its value is its name, as
// results, errors and rules files spell it.
type Algorithm string

// The algorithms. Each is one Lua script that reads Redis TIME.
const (
	// FixedWindow counts permits in windows aligned to multiples of Period.
	// Cheapest; admits up to 2 × Count across a window boundary.
	FixedWindow Algorithm = "fixed_window"
	// SlidingLog remembers every permit for one Period: exact, memory ∝ Count.
	SlidingLog Algorithm = "sliding_log"
	// SlidingWindow counts permits in buckets of Rule.Precision; never more
	// than Count in any Period, memory ∝ Period / Precision.
	SlidingWindow Algorithm = "sliding_window"
	// TokenBucket refills Count tokens per Period up to Burst.
	TokenBucket Algorithm = "token_bucket"
	// GCRA is the leaky bucket as the generic cell rate algorithm: one
	// timestamp per key, smooth pacing at Period / Count, bursts up to
	// Burst.
	GCRA Algorithm = "gcra"
	// Concurrency limits how many holders of a subject run at once, across
	// every process: Limit.Count places, each held under a lease of
	// Limit.Period (the lease; 30s is a good default) that the holder's
	// process renews while it runs, so that a process that dies frees its
	// places within the lease. Take a place with Wait (or Admit), give it
	// back with Release. A caller that finds every place taken waits in a
	// first-come, first-served queue per subject and is handed the next
	// place that frees. A policy may hold one Concurrency rule beside its
	// rate rules (20/s and at most 5 at once), decided in the same call,
	// all over the caller's subject (no Rule.Subject).
	Concurrency Algorithm = "concurrency"
	// CalendarWindow is a fixed window aligned to the calendar of a time
	// zone (Rule.Calendar): Limit.Count permits a day, a week or a month,
	// reset at midnight on the zone's wall clock, however long daylight
	// saving makes that day (23 or 25 hours) or month. A policy may hold
	// it beside per-second rules, decided in the same call. Like
	// FixedWindow it may admit up to 2 × Count across a boundary; it
	// books ahead into the next window only.
	//
	// The boundaries are computed in Go with the zone's rules and sent
	// with each call: the window around this process's estimate of Redis
	// TIME (learnt from the replies) and the next one. The script picks
	// between them by Redis TIME, so a call that crosses midnight, or a
	// process clock off by a little, counts in the right window; a reply
	// whose Redis TIME is outside both tells the process its estimate was
	// wrong (a clock step), and Allow, Reserve, Wait and PrepayN ask again
	// with windows around it, having charged nothing.
	CalendarWindow Algorithm = "calendar"
)

// Rule is one named limit over a subject.
type Rule struct {
	// Name identifies the rule in keys, results and errors. Non-empty;
	// unique within a Limiter.
	Name      string
	Algorithm Algorithm
	Limit     Limit
	// Precision is the bucket width of a SlidingWindow rule. If zero,
	// Period / 20 is used (at least 1µs). Ignored by other algorithms.
	Precision time.Duration
	// Subject, if not empty, is what the rule limits whatever the
	// caller's subject: a global limit ("all") beside per-tenant rules.
	// Rules over one subject (their Subject, or the caller's if empty) are
	// checked and charged together in one atomic call. Rules over
	// different subjects are acquired one subject after another, in the
	// order of their first rule, and a request that one refuses gives
	// back what the others took: it keeps nothing. A request one subject
	// holds back is charged to the others at the turn it acts, not at
	// their own earlier one (a subject booked before a later subject's
	// turn is given back and booked again at it: two more calls; the
	// subject that set the last turn is asked first, so a busy shared one
	// mostly leaves none to move). Admit does so for bucket rules without
	// a Horizon or ShareLimit (AdmitRequest.NotBefore). Such a limiter cannot
	// PrepayN or AllowAtMost, and its Admit books nothing (a turn later
	// than the request's Wait is Denied).
	Subject string
	// Calendar places the windows of a CalendarWindow rule on a time
	// zone's calendar (Daily, Weekly, Monthly); such a rule's Limit needs
	// only Count. Other algorithms must leave it zero.
	Calendar Calendar
}

// describe describes the rule for messages, such as "api: gcra 20 per 1s
// (burst 20)" or "exports: concurrency, at most 5 at once, lease 30s".
func (r Rule) describe() string {
	if r.Algorithm == Concurrency {
		return fmt.Sprintf("%s: concurrency, at most %d at once, lease %v", r.Name, r.Limit.Count, r.Limit.Period)
	}
	return fmt.Sprintf("%s: %s %s", r.Name, r.Algorithm, r.Limit.describe())
}

// Validate reports whether r is usable, with an error naming the rule and
// the field.
func (r Rule) Validate() error {
	if r.Name == "" {
		return &ConfigError{Field: "name", Reason: "must not be empty"}
	}
	spec := r.Algorithm.spec()
	if spec == nil {
		return &ConfigError{Rule: r.Name, Field: "algorithm", Reason: fmt.Sprintf("%q is not one of %s", r.Algorithm, algorithmList())}
	}
	if r.Calendar != (Calendar{}) && r.Algorithm != CalendarWindow {
		return &ConfigError{Rule: r.Name, Field: "calendar", Reason: fmt.Sprintf("applies only to %s; %s windows follow its period", CalendarWindow, r.Algorithm)}
	}
	if r.Algorithm == CalendarWindow {
		if err := validateCalendar(r); err != nil {
			return err // before the limit's checks: a zero Period is the calendar's
		}
	}
	if err := r.normal().Limit.validate(); err != nil {
		err.(*ConfigError).Rule = r.Name
		return err
	}
	if r.Subject != "" {
		if _, err := encodeSubject(r.Subject); err != nil {
			return &ConfigError{Rule: r.Name, Field: "subject", Reason: err.Error()}
		}
	}
	if spec.validate != nil {
		return spec.validate(r)
	}
	return nil
}

// normal returns r as a limiter keeps it: a CalendarWindow rule's Period
// is its calendar unit's nominal length (Calendar.Period), its Burst
// its Count.
func (r Rule) normal() Rule {
	if r.Algorithm == CalendarWindow && r.Limit.Period == 0 && r.Calendar.unit != 0 {
		r.Limit.Period = r.Calendar.Period()
	}
	if r.Algorithm == CalendarWindow && r.Limit.Burst == 0 {
		r.Limit.Burst = r.Limit.Count
	}
	return r
}

func fieldError(field string, v any, reason string) error {
	return &ConfigError{Field: field, Reason: fmt.Sprintf("%v %s", v, reason)}
}
