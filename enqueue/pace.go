package enqueue

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// PaceSpec names the ledger a batch is paced in: a rule of the workers'
// rules file (preferred: it cannot disagree with the workers), or the same
// rule spelled out inline.
//
// A paced task is charged once only if the worker's middleware finds its
// receipt under the same prefix, subject and rule names: an inline rule
// that differs from the workers' makes every task be charged twice.
type PaceSpec struct {
	// Rules is the workers' rules file (rules.Load). If set, the
	// batch is paced under the rule the workers apply to its task type
	// (Config.RuleFor); Rule, if also set, must name that rule.
	Rules *rules.Config
	// Rule is the rule's name: with Rules, a check; inline, the name the
	// workers' rules file gives the rule (the last part of its Redis key).
	Rule string

	// Inline, when Rules is nil: the workers' rule.
	Prefix    string              // key prefix; if empty, throttle.DefaultPrefix
	Algorithm throttle.Algorithm  // if zero, GCRA
	Limit     throttle.Limit      // count per period, burst
	Subject   rules.SubjectConfig // exactly one of Fixed and PayloadField

	// Keep is how long a receipt outlives its slot (Pacer.Keep).
	Keep time.Duration
	// Lead schedules each task this long before its slot (Pacer.Lead),
	// for workers without wake-ups. If zero, each task is recorded in the
	// workers' wake-up ledger (admission.WakeupsKey on the same Redis,
	// Pacer.Wakeups) instead, which workers with worker.Options.Asynq (as
	// cmd/worker runs) use to start it on its slot.
	Lead time.Duration
	// WakeupShards is the number of keys of the workers' wake-up ledger
	// (worker.Options.WakeupShards): the same as the workers', or fewer.
	// If zero, admission.DefaultWakeupShards.
	WakeupShards int
}

// Reach is how far ahead of its booking a paced task's slot is, at the
// soonest (throttle.Options.PrepayAfter, for gcra and token_bucket rules):
// the time a task needs to reach a worker, woken from the wake-up ledger
// (admission.DefaultLead before its slot, on a look every
// admission.DefaultTick) or moved by asynq's forwarder, then picked up
// (worker.CheckInterval). A slot sooner, as the first of a batch on an
// idle rule was, found its task late for its receipt: the task was
// charged a second time and ran at the end of the batch. A batch's first
// task thus starts Reach after the batch does.
const Reach = 500 * time.Millisecond

// wakeups returns the ledger a Pacer records its tasks in: the workers'
// on rdb, unless a Lead asks for whole-second scheduling instead.
func (s *PaceSpec) wakeups(rdb redis.UniversalClient) (*admission.Wakeups, error) {
	if s.Lead > 0 {
		return nil, nil
	}
	return admission.NewShardedWakeups(rdb, admission.WakeupsKey, s.WakeupShards)
}

// Pacer builds the Pacer for batches of taskType on rdb. base supplies the
// limiter's Logger and OnRedisError. Errors name what to fix. It does not
// call Redis.
func (s *PaceSpec) Pacer(rdb redis.UniversalClient, taskType string, base throttle.Options) (*Pacer, error) {
	subject, cost, err := s.terms(taskType)
	if err != nil {
		return nil, err
	}
	var lim *throttle.Limiter
	if s.Rules != nil {
		rc, _ := s.Rules.RuleFor(taskType) // terms found it
		base.PrepayAfter = Reach
		if lim, err = s.Rules.Limiter(rdb, rc.Name, base); err != nil {
			return nil, err
		}
	} else {
		algo := s.Algorithm
		if algo == "" {
			algo = throttle.GCRA
		}
		lim, err = throttle.New(rdb, throttle.Options{Prefix: s.prefix(), Logger: base.Logger, OnRedisError: base.OnRedisError, PrepayAfter: Reach},
			throttle.Rule{Name: s.Rule, Algorithm: algo, Limit: s.Limit})
		if err != nil {
			return nil, fmt.Errorf("enqueue: pace: %w", err)
		}
	}
	w, err := s.wakeups(rdb)
	if err != nil {
		return nil, fmt.Errorf("enqueue: pace: %w", err)
	}
	return &Pacer{Limiter: lim, Subject: subject, Cost: cost, Costs: s.costs(taskType), Keep: s.Keep, Lead: s.Lead, Wakeups: w, check: checker(rdb, s.prefix(), lim)}, nil
}

// costs returns how the workers derive a task's costs per limit from its
// payload under s, for tasks of taskType: the rule's, if its policy's
// limits have costs of their own (rules.RuleConfig.Costs); else nil.
func (s *PaceSpec) costs(taskType string) func([]byte) (throttle.Costs, error) {
	if s.Rules == nil {
		return nil
	}
	rc, err := s.rule(taskType)
	if err != nil || rc.LimitCosts == nil {
		return nil
	}
	return rc.Costs
}

// terms returns how the workers derive a task's subject and cost from its
// payload under s, for tasks of taskType: the rule's of the rules file,
// or the inline subject (and a cost of one).
func (s *PaceSpec) terms(taskType string) (subject func([]byte) (string, error), cost func([]byte) (int, error), err error) {
	if s.Rules != nil {
		rc, err := s.rule(taskType)
		if err != nil {
			return nil, nil, err
		}
		return rc.Subject.Of, rc.Cost.Of, nil
	}
	if !yamlfile.ValidName(s.Rule) {
		return nil, nil, fmt.Errorf("enqueue: pace rule name %q: use the name of the workers' rule (%s)", s.Rule, yamlfile.NameRule)
	}
	if (s.Subject.Fixed == "") == (s.Subject.PayloadField == "") {
		return nil, nil, errors.New("enqueue: pace subject: give exactly one of a fixed subject and a payload field, as the workers' rule does")
	}
	return s.Subject.Of, nil, nil
}

// prefix returns the workers' key prefix the pacer books under.
func (s *PaceSpec) prefix() string {
	if s.Rules != nil {
		return cmp.Or(s.Rules.Prefix, throttle.DefaultPrefix)
	}
	return cmp.Or(s.Prefix, throttle.DefaultPrefix)
}

// checker returns a Pacer's check: lim's rules against the limits the
// workers published under prefix (admission.CheckLimits).
func checker(rdb redis.UniversalClient, prefix string, lim *throttle.Limiter) func(context.Context) error {
	return func(ctx context.Context) error {
		if err := admission.CheckLimits(ctx, rdb, prefix, lim.Rules()); err != nil {
			return fmt.Errorf("enqueue: pace: %w", err)
		}
		return nil
	}
}

// rule returns the rule of s.Rules that the workers apply to taskType,
// checking that it agrees with s.Rule.
func (s *PaceSpec) rule(taskType string) (rules.RuleConfig, error) {
	rc, ok := s.Rules.RuleFor(taskType)
	switch {
	case !ok && s.Rule != "":
		return rc, fmt.Errorf("enqueue: %s: rule %q does not apply to tasks of type %q, so the workers would charge them again; list the type in its tasks", s.Rules.File, s.Rule, taskType)
	case !ok:
		return rc, fmt.Errorf("enqueue: %s: no rule applies to tasks of type %q: the workers do not limit them, so there is nothing to pace against", s.Rules.File, taskType)
	case s.Rule != "" && s.Rule != rc.Name:
		return rc, fmt.Errorf("enqueue: %s: the workers apply rule %q to tasks of type %q, not %q; pacing under %q would charge every task twice", s.Rules.File, rc.Name, taskType, s.Rule, s.Rule)
	case rc.ShareLimit != (throttle.Limit{}):
		// A receipt is a turn of the rule's limits; the share's own limit
		// is kept in the workers' line, which a booking made here does not
		// pass through: a paced batch of one share would go past it.
		return rc, fmt.Errorf("enqueue: %s: rule %q holds each share (its %s) to a limit of its own in the workers' line, which a paced booking cannot hold: enqueue these tasks without pacing, and the workers park them at the rule's pace", s.Rules.File, rc.Name, shareWords(rc))
	}
	return rc, nil
}

// shareWords names what a rule's shares are: "fair_by payload field
// \"api_key\"" (a nested rule's own subject, rules.RuleConfig.Nested).
func shareWords(rc rules.RuleConfig) string {
	if rc.FairBy.PayloadField != "" {
		return fmt.Sprintf("fair_by payload field %q", rc.FairBy.PayloadField)
	}
	return fmt.Sprintf("fair_by %q", rc.FairBy.Fixed)
}

// ParseRate parses a rate written count/period, such as "20/s", "100/m",
// "5000/h", "20000/d" or "3/500ms" (any Go duration), into a Limit with
// the given burst.
func ParseRate(s string, burst int) (throttle.Limit, error) {
	count, per, ok := strings.Cut(strings.TrimSpace(s), "/")
	if !ok {
		return throttle.Limit{}, fmt.Errorf("rate %q: write count/period, such as 20/s, 100/m or 3/500ms", s)
	}
	count = strings.TrimSpace(count)
	n, err := strconv.Atoi(count)
	switch {
	case errors.Is(err, strconv.ErrRange) && !strings.HasPrefix(count, "-"), err == nil && n > throttle.MaxPermits:
		return throttle.Limit{}, fmt.Errorf("rate %q: the count %q is too large: at most %d", s, count, throttle.MaxPermits)
	case err != nil || n < 1:
		return throttle.Limit{}, fmt.Errorf("rate %q: the count %q must be a whole number of at least 1", s, count)
	case burst < 1:
		return throttle.Limit{}, fmt.Errorf("rate %q: the burst %d must be at least 1: the most permits admitted at one instant", s, burst)
	}
	per = strings.TrimSpace(per)
	var period time.Duration
	switch per {
	case "s", "sec", "second":
		period = time.Second
	case "m", "min", "minute":
		period = time.Minute
	case "h", "hour":
		period = time.Hour
	case "d", "day":
		period = 24 * time.Hour
	default:
		if period, err = time.ParseDuration(per); err != nil {
			return throttle.Limit{}, fmt.Errorf("rate %q: the period %q must be s, m, h, d or a duration such as 500ms", s, per)
		}
	}
	l := throttle.Limit{Count: n, Period: period, Burst: burst}
	if err := (throttle.Rule{Name: "rate", Algorithm: throttle.GCRA, Limit: l}).Validate(); err != nil {
		var ce *throttle.ConfigError
		if errors.As(err, &ce) {
			return throttle.Limit{}, fmt.Errorf("rate %q: %s: %s", s, ce.Field, ce.Reason)
		}
		return throttle.Limit{}, fmt.Errorf("rate %q: %w", s, err)
	}
	return l, nil
}
