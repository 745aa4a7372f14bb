package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// check prints the rules and handlers of a valid rules file as the worker
// understands them, for `worker --check` (what CI runs on a rules change),
// once validate has passed them.
func check(w io.Writer, cfg *rules.Config, handlers *handler.Config) {
	fmt.Fprintf(w, "%s: OK: %s, %s; prefix %q, fail_open %v\n", cfg.File, count(len(cfg.Rules), "rule"), count(len(handlers.Handlers), "handler"), cfg.Prefix, cfg.FailOpen)
	for _, r := range cfg.Rules {
		d := describeRule(r)
		fmt.Fprintf(w, "rule %q (line %d): tasks %s; subject: %s; max_wait: %s\n", r.Name, r.Line, d.Tasks, d.Subject, d.MaxWait)
		for _, l := range d.Limits {
			fmt.Fprintf(w, "  limit %s\n", l)
		}
		for _, l := range r.Limits {
			if l.Algorithm == throttle.CalendarWindow {
				where := "what remains of it is on the status page and in /metrics"
				if r.Subject.PayloadField != "" {
					where = "one quota per subject, which a worker cannot list: no page or metric shows what remains"
				}
				fmt.Fprintf(w, "  %s (on this machine's clock; %s)\n", calendarWords(l, time.Now()), where)
			}
		}
		if d.Waiting != "" {
			fmt.Fprintf(w, "  line: %s\n", d.Waiting)
		}
		switch {
		case r.Nested:
			fmt.Fprintf(w, "  within rule %q, nested: its tasks take turns of that rule's limits, each %s a share of its line limited by this rule's limit, in one atomic call; a task parks once\n", r.Within, describeSubject(r.FairBy))
		case r.Within != "":
			fmt.Fprintf(w, "  within rule %q: its tasks also take a turn of it, and park once, on the slower of the two\n", r.Within)
		}
	}
	for _, h := range handlers.Handlers {
		rule := "no rule limits it"
		if rc, ok := cfg.RuleFor(h.Task); ok {
			rule = fmt.Sprintf("limited by rule %q", rc.Name)
			if rc.Within != "" {
				rule += fmt.Sprintf(" within rule %q", rc.Within)
			}
		}
		fmt.Fprintf(w, "handler %q (line %d): %s; %s\n", h.Task, h.Line, h.Describe(), rule)
	}
}

// ruleWords is a rule of the rules file in words, as --check prints it
// and the status page shows it.
type ruleWords struct {
	Tasks   string   // "partner:*, partner-v2:*"
	Subject string   // `payload field "account_id"` or `fixed "all"`
	MaxWait string   // "30s", or "1s (the default)"
	Limits  []string // describeLimit of each limit
	Waiting string   // describeLine: the settings of the subject's line; "" if all are defaults
}

// describeRule is r in words.
func describeRule(r rules.RuleConfig) ruleWords {
	d := ruleWords{Tasks: strings.Join(r.Tasks, ", "), Subject: describeSubject(r.Subject), Waiting: describeLine(r)}
	// A rule's limiter is a *throttle.Limiter, which books turns: an
	// unset max_wait is the admission gate's default.
	d.MaxWait = admission.DefaultMaxWait.String() + " (the default)"
	if r.MaxWait > 0 {
		d.MaxWait = r.MaxWait.String()
	}
	for i, l := range r.Limits {
		s := describeLimit(l)
		if r.LimitCosts != nil {
			s += "; cost " + describeCost(r.LimitCost(i))
		}
		if r.Nested {
			s += fmt.Sprintf(" (rule %q's)", r.Within)
		}
		d.Limits = append(d.Limits, s)
	}
	return d
}

// describeSubject is a rule's subject in words: `payload field "key"` or
// `fixed "all"`.
func describeSubject(s rules.SubjectConfig) string {
	if s.PayloadField == "" {
		return fmt.Sprintf("fixed %q", s.Fixed)
	}
	return fmt.Sprintf("payload field %q", s.PayloadField)
}

// describeCost is a cost in words: `payload field "input_tokens"`, or a
// number of permits.
func describeCost(c rules.CostConfig) string {
	if c.PayloadField != "" {
		return fmt.Sprintf("payload field %q", c.PayloadField)
	}
	return fmt.Sprint(max(c.Permits, 1))
}

// describeLimit is one limit in words: "api: gcra, 20 per 1s, burst 5".
func describeLimit(l throttle.Rule) string {
	if l.Algorithm == throttle.Concurrency {
		return fmt.Sprintf("%s: concurrency, at most %d at once, lease %v", l.Name, l.Limit.Count, l.Limit.Period)
	}
	if l.Algorithm == throttle.CalendarWindow {
		return fmt.Sprintf("%s: calendar, %d per %v", l.Name, l.Limit.Count, l.Calendar)
	}
	s := fmt.Sprintf("%s: %v, %d per %v", l.Name, l.Algorithm, l.Limit.Count, l.Limit.Period)
	switch {
	case l.Algorithm.Bucket():
		s += fmt.Sprintf(", burst %d", l.Limit.Burst)
	case l.Algorithm == throttle.SlidingWindow:
		if l.Precision > 0 {
			s += fmt.Sprintf(", precision %v", l.Precision)
		} else {
			s += fmt.Sprintf(", precision %v (period/20)", l.Limit.Period/20)
		}
	}
	return s
}

// calendarWords is the window of calendar limit l that holds now, in the
// wall time of its zone: "daily: this day runs from 2026-11-26 00:00 PST
// to 2026-11-27 00:00 PST; it resets in 20h31m".
func calendarWords(l throttle.Rule, now time.Time) string {
	start, end := l.Calendar.Window(now)
	const wall = "2006-01-02 15:04 MST"
	return fmt.Sprintf("%s: this %v runs from %s to %s; it resets in %v", l.Name, l.Calendar.Unit(),
		start.Format(wall), end.Format(wall), end.Sub(now).Round(time.Second))
}

// describeLine is what a rule sets of its subject's line, in words
// ("horizon 2s; fair_by payload field "tenant", weights gold=3; share_limit
// 10 per 1s, burst 10"), or "" if it keeps every default.
func describeLine(r rules.RuleConfig) string {
	var parts []string
	if r.Horizon > 0 {
		parts = append(parts, "horizon "+r.Horizon.String())
	}
	if fb := r.FairBy; fb != (rules.SubjectConfig{}) {
		s := fmt.Sprintf("fair_by payload field %q", fb.PayloadField)
		if fb.PayloadField == "" {
			s = fmt.Sprintf("fair_by fixed %q", fb.Fixed)
		}
		if len(r.Weights) > 0 {
			var ws []string
			for share, n := range r.Weights {
				ws = append(ws, fmt.Sprintf("%s=%d", share, n))
			}
			slices.Sort(ws)
			s += ", weights " + strings.Join(ws, " ")
		}
		parts = append(parts, s)
	}
	if sl := r.ShareLimit; sl.Count > 0 {
		parts = append(parts, fmt.Sprintf("share_limit %d per %v, burst %d", sl.Count, sl.Period, sl.Burst))
	}
	if p := describePriority(r); p != "" {
		parts = append(parts, p)
	}
	return strings.Join(parts, "; ")
}

// describePriority is a rule's priority in words: where a task's level
// comes from, and the age bound, `priority from payload field "p" (0-9,
// higher first), age bound 30s`; "" without one.
func describePriority(r rules.RuleConfig) string {
	p := r.Priority
	var from string
	switch {
	case p.PayloadField != "":
		from = fmt.Sprintf("payload field %q", p.PayloadField)
	case p.Queues != nil:
		var qs []string
		for q, n := range p.Queues {
			qs = append(qs, fmt.Sprintf("%s=%d", q, n))
		}
		slices.Sort(qs)
		from = "queues " + strings.Join(qs, " ")
	default:
		return ""
	}
	bound := r.AgeBound().String()
	if r.MaxAge == 0 {
		bound += " (the default)"
	}
	return fmt.Sprintf("priority from %s (0-%d, higher first), age bound %s: a task that waited that long goes before every task that joined after it", from, admission.MaxPriority, bound)
}

// count is "1 rule", "2 rules".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
