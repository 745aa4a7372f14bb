package throttle

import (
	"fmt"
	"math"
	"strings"
	"time"
)

// Limit is a rate: Count permits per Period, with bursts of up to Burst
// permits at one instant. Burst matters to the token bucket and the leaky
// bucket; the window algorithms admit Count per Period and ignore it.
//
// Build one with PerSecond, PerMinute, PerHour, PerDay or Every, and adjust
// the burst with WithBurst. A Limit is checked when a Limiter is built.
type Limit struct {
	Count  int           // permits per Period; at least 1
	Period time.Duration // at least 1µs, at most MaxPeriod
	Burst  int           // bucket capacity; at least 1 (for the bucket algorithms)
}

// Bounds on a Limit, chosen so that every time a script computes stays an
// exact integer number of microseconds in a Lua double (below 2^53).
const (
	// MaxPeriod is the longest Period (and the longest burst horizon,
	// Burst × Period / Count) a Limit may have.
	MaxPeriod = 10 * 365 * 24 * time.Hour
	// MaxCount bounds Count and Burst.
	MaxCount = 1 << 40
	// MaxLogCount bounds Count for SlidingLog, which stores one sorted-set
	// member per permit; use SlidingWindow for larger counts.
	MaxLogCount = 1_000_000
	// MaxBuckets bounds Period / Precision for SlidingWindow, which stores
	// one hash field per bucket.
	MaxBuckets = 10_000
)

// PerSecond returns a limit of n permits per second, burst n.
func PerSecond(n int) Limit { return Limit{Count: n, Period: time.Second, Burst: n} }

// PerMinute returns a limit of n permits per minute, burst n.
func PerMinute(n int) Limit { return Limit{Count: n, Period: time.Minute, Burst: n} }

// PerHour returns a limit of n permits per hour, burst n.
func PerHour(n int) Limit { return Limit{Count: n, Period: time.Hour, Burst: n} }

// PerDay returns a limit of n permits per 24 hours, burst n.
func PerDay(n int) Limit { return Limit{Count: n, Period: 24 * time.Hour, Burst: n} }

// Every returns a limit of one permit per interval, burst 1.
func Every(interval time.Duration) Limit { return Limit{Count: 1, Period: interval, Burst: 1} }

// WithBurst returns a copy of l whose Burst is b.
func (l Limit) WithBurst(b int) Limit { l.Burst = b; return l }

// FromRate converts a rate in permits per second, possibly fractional, to a
// Limit with the given burst: 2.5 becomes 25 per 10s. It returns an error
// for NaN, infinities, rates ≤ 0 and rates too small or too large to express.
func FromRate(perSecond float64, burst int) (Limit, error) {
	if math.IsNaN(perSecond) || math.IsInf(perSecond, 0) || perSecond <= 0 {
		return Limit{}, fmt.Errorf("throttle: rate %v: must be a finite number of permits per second above 0", perSecond)
	}
	// The smallest power-of-ten period that makes the count whole (to
	// nine significant digits), so 0.5/s is 5 per 10s, not 1 per 2s
	// approximated.
	for scale := 1.0; scale <= 1e9; scale *= 10 {
		c := perSecond * scale
		if c > MaxCount {
			break
		}
		if r := math.Round(c); r >= 1 && math.Abs(c-r) <= 1e-9*c {
			l := Limit{Count: int(r), Period: time.Duration(scale * float64(time.Second)), Burst: burst}
			if err := l.validate(); err != nil {
				return l, err
			}
			return l, validateBurst(Rule{Limit: l})
		}
	}
	return Limit{}, fmt.Errorf("throttle: rate %v per second cannot be expressed as a whole count per period up to %v", perSecond, MaxPeriod)
}

// Interval is the time between two permits at the steady rate: Period / Count.
func (l Limit) Interval() time.Duration {
	if l.Count <= 0 {
		return 0
	}
	return l.Period / time.Duration(l.Count)
}

// String describes the limit, such as "20 per 1s (burst 20)".
func (l Limit) String() string {
	return fmt.Sprintf("%d per %v (burst %d)", l.Count, l.Period, l.Burst)
}

// validate reports the first invalid field that every limit checks.
func (l Limit) validate() error {
	switch {
	case l.Count < 1:
		return fieldError("count", l.Count, "must be at least 1")
	case l.Count > MaxCount:
		return fieldError("count", l.Count, fmt.Sprintf("must be at most %d", MaxCount))
	case l.Period < time.Microsecond:
		return fieldError("period", l.Period, "must be at least 1µs")
	case l.Period > MaxPeriod:
		return fieldError("period", l.Period, fmt.Sprintf("must be at most %v", MaxPeriod))
	}
	return nil
}

// capacity is the largest request l can ever admit under algorithm a.
func (l Limit) capacity(a Algorithm) int {
	if s := a.spec(); s != nil && s.holders {
		return MaxCount // a holder takes one place, whatever its n
	}
	if a.bucket() {
		return l.Burst
	}
	return l.Count
}

// Algorithm selects how a rule counts permits.
type Algorithm int

// The algorithms. Each is one Lua script that reads Redis TIME.
const (
	// FixedWindow counts permits in windows aligned to multiples of Period.
	// Cheapest; admits up to 2 × Count across a window boundary.
	FixedWindow Algorithm = iota + 1
	// SlidingLog remembers every permit for one Period: exact, memory ∝ Count.
	SlidingLog
	// SlidingWindow counts permits in buckets of Rule.Precision; never more
	// than Count in any Period, memory ∝ Period / Precision.
	SlidingWindow
	// TokenBucket refills Count tokens per Period up to Burst. Wait reserves.
	TokenBucket
	// GCRA is the leaky bucket as the generic cell rate algorithm: one
	// timestamp per key, smooth pacing at Interval, bursts up to Burst. Wait
	// reserves.
	GCRA
	// Concurrency limits how many holders of a subject run at once, across
	// every process: Limit.Count places, each held under a lease of
	// Limit.Period (the lease; 30s is a good default) that the holder's
	// process renews while it runs, so that a process that dies frees its
	// places within the lease. Take a place with Wait (or Admit), give it
	// back with Release. A caller that finds every place taken waits in a
	// first-come, first-served queue per subject and is handed the next
	// place that frees. A policy may hold one Concurrency rule beside its
	// rate rules (20/s and at most 5 at once), decided in the same call.
	Concurrency
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
}

// String describes the rule, such as "api: gcra 20 per 1s (burst 20)" or
// "exports: concurrency, at most 5 at once, lease 30s".
func (r Rule) String() string {
	if r.Algorithm == Concurrency {
		return fmt.Sprintf("%s: concurrency, at most %d at once, lease %v", r.Name, r.Limit.Count, r.Limit.Period)
	}
	return fmt.Sprintf("%s: %v %v", r.Name, r.Algorithm, r.Limit)
}

// Validate reports whether r is usable, with an error naming the rule and
// the field.
func (r Rule) Validate() error {
	if r.Name == "" {
		return &ConfigError{Field: "name", Reason: "must not be empty"}
	}
	spec := r.Algorithm.spec()
	if spec == nil {
		return &ConfigError{Rule: r.Name, Field: "algorithm", Reason: fmt.Sprintf("%v is not one of %s", r.Algorithm, strings.Join(algorithmNames(), ", "))}
	}
	if err := r.Limit.validate(); err != nil {
		err.(*ConfigError).Rule = r.Name
		return err
	}
	if spec.validate != nil {
		return spec.validate(r)
	}
	return nil
}

func fieldError(field string, v any, reason string) error {
	return &ConfigError{Field: field, Reason: fmt.Sprintf("%v %s", v, reason)}
}
