package admission

import (
	"errors"
	"fmt"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Settings are how the jobs of one rule are admitted: how long they wait
// where they are, how many of a subject wait at once, how far ahead their
// turns are booked, and how a subject's line is shared. They are declared
// once, here, and embedded where a rule is written: Options (a Gate),
// rules.RuleConfig (the rules file: max_wait, wait_slots, horizon, weights,
// share_limit) and worker.TaskRule. The zero value uses every default;
// Check says whether a value is one Gate accepts.
type Settings struct {
	// MaxWait is the longest a job waits where it is (holding, say, a
	// worker slot) for a new turn; a later turn is booked and the job
	// parks. If zero, DefaultMaxWait; it never exceeds the context's
	// deadline. Must not be negative.
	MaxWait time.Duration
	// WaitSlots bounds how many jobs of one subject wait in this process
	// for a new turn, so that a subject over its limit cannot fill every
	// worker slot with waiting jobs: the others park at once. If zero,
	// DefaultWaitSlots. Must not be negative.
	WaitSlots int
	// Horizon bounds how far ahead a parked job's turn is booked. A job
	// whose turn would be later, or that comes while others of its
	// subject wait, waits in the subject's line in Redis instead, charged
	// nothing (Decision.InLine), and is booked when the horizon reaches it
	// (Gate.Serve, which Parking runs, or the caller when Decision.Serve
	// says; with a Parking, the line's head when it comes back for its
	// turn). So a backlog of any depth holds at most a horizon of booked
	// turns: a limit that changes is in force within about a horizon, and
	// a subject's shares are served in turn. If zero, DefaultHorizon (1s);
	// at most MaxHorizon. Negative: no bound and no line; every parked job
	// books its turn at once, however far ahead (for a caller that cannot
	// serve the line). A limiter with a Concurrency rule has no line; its
	// queue for places serves the same end.
	Horizon time.Duration
	// Weights weigh the shares of a subject's line (throttle.Caller.Share,
	// a tenant): a share of weight 3 gets three turns for one of a share
	// of weight 1, the weight of a share not listed. Each from 1 to
	// MaxWeight. A Gate gives a job its share's weight unless the
	// request's Caller.Weight is set.
	Weights map[string]int
	// ShareLimit, if set (not the zero Limit), limits each share of a
	// subject's line on its own, as a leaky bucket
	// (throttle.AdmitRequest.ShareLimit): a per-tenant limit inside an API
	// key's, decided in the same script. It needs the line (a Horizon not
	// negative), jobs with an ID, and a limiter whose rules can keep
	// shares (throttle.Limit.CheckShare); a zero Burst is Count.
	ShareLimit throttle.Limit
	// MaxAge is the age bound of a subject's line whose jobs have
	// priorities (Request.Priority, throttle.Caller.Priority: the line
	// serves higher levels first): a job that has waited in line MaxAge is
	// served before every job that joined after it, whatever their
	// levels. Set, it is given to every job of the gate, those of level 0
	// too, which then never wait behind younger higher jobs for longer.
	// If zero, a job above level 0 has throttle's default
	// (DefaultMaxAge horizons) and a job of level 0 is never
	// promoted: the worker sets it for every rule with a priority. Not
	// with ShareLimit. Must not be negative.
	MaxAge time.Duration
}

// Bounds of Settings.
const (
	// MaxWeight bounds each of Settings.Weights (and
	// throttle.Caller.Weight).
	MaxWeight = 1000
	// MaxHorizon bounds Settings.Horizon: bookings a day ahead are no line.
	MaxHorizon = 24 * time.Hour
	// MaxPriority bounds Request.Priority (throttle.Caller.Priority, which
	// throttle bounds by the same number): a subject's line has ten
	// levels, 0 to 9, and serves 9 first.
	MaxPriority = 9
)

// SettingsError is a field of Settings out of range (Settings.Check).
type SettingsError struct {
	Field  string // max_wait, wait_slots, horizon, weights, share_limit or priority, as in a rules file
	Reason string // what is wrong and what is allowed
	Err    error  // the cause, if throttle found it (a *throttle.ConfigError); else nil
}

// Error names the field and says what is allowed.
func (e *SettingsError) Error() string { return fmt.Sprintf("admission: %s: %s", e.Field, e.Reason) }

// Unwrap returns the cause, if any.
func (e *SettingsError) Unwrap() error { return e.Err }

// Check returns a *SettingsError for the first field of s that a Gate
// over a limiter of rules cannot take (rules: the limiter's, to check that
// they can keep ShareLimit's shares; none to check ShareLimit alone).
// rules, worker and New all check settings with it.
func (s Settings) Check(rules ...throttle.Rule) error {
	bad := func(field, format string, args ...any) error {
		return &SettingsError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case s.MaxWait < 0:
		return bad("max_wait", "%v must not be negative", s.MaxWait)
	case s.WaitSlots < 0:
		return bad("wait_slots", "%d must not be negative", s.WaitSlots)
	case s.Horizon > MaxHorizon:
		return bad("horizon", "%v must be at most %v", s.Horizon, MaxHorizon)
	case s.MaxAge < 0:
		return bad("priority", "max_age %v must not be negative", s.MaxAge)
	case s.MaxAge > 0 && s.ShareLimit != (throttle.Limit{}):
		return bad("priority", "cannot be combined with share_limit: a share its own limit holds back is served in its share's order, not by level; drop one")
	}
	for share, w := range s.Weights {
		if w < 1 || w > MaxWeight {
			return bad("weights", "share %q: weight %d must be between 1 and %d", share, w, MaxWeight)
		}
	}
	if s.ShareLimit != (throttle.Limit{}) {
		if _, err := s.ShareLimit.CheckShare(rules...); err != nil {
			reason := err.Error() // a field of ShareLimit: throttle names it
			var ce *throttle.ConfigError
			if errors.As(err, &ce) && ce.Rule != "share_limit" {
				reason = ce.Reason // a rule of the limiter's that cannot keep shares
			}
			return &SettingsError{Field: "share_limit", Reason: reason, Err: err}
		}
	}
	return nil
}

// withDefaults returns s with each zero field that has a default set to it.
// AgeBound is the age bound of a line whose jobs have priorities: MaxAge,
// else DefaultMaxAge horizons (DefaultHorizon if Horizon is not
// above zero), the bound throttle gives a job above level 0.
func (s Settings) AgeBound() time.Duration {
	if s.MaxAge > 0 {
		return s.MaxAge
	}
	h := s.Horizon
	if h <= 0 {
		h = DefaultHorizon
	}
	return DefaultMaxAge * h
}

func (s Settings) withDefaults() Settings {
	if s.MaxWait == 0 {
		s.MaxWait = DefaultMaxWait
	}
	if s.WaitSlots == 0 {
		s.WaitSlots = DefaultWaitSlots
	}
	if s.Horizon == 0 {
		s.Horizon = DefaultHorizon
	}
	return s
}
