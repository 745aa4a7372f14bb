package main

import (
	"bytes"
	_ "embed"
	"fmt"
	"html/template"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// statusHTML is the status page's template: plain HTML with an inline SVG
// plot per rule, no script and no external asset.
//
//go:embed status.html
var statusHTML string

var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{
	"clock": func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
	"num":   func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
}).Parse(statusHTML))

// status is what a worker's status page shows (served at / and /status
// beside /metrics): the rules in force and where they came from, each
// rule's recent activity (worker.Activity, the same counts as the
// metrics), what remains of its calendar quotas, the handlers, and their
// recent failures. It holds everything in memory but the quotas: serving
// the page costs no Redis call, unless the rules have a calendar quota of
// a fixed subject and no scrape or page read them in the last
// quotaPageAge; then one call per such quota, within
// worker.QuotaReadTimeout.
type status struct {
	started  time.Time
	activity *worker.Activity          // nil without metrics: every count zero
	learned  func(rule string) float64 // the upstream rate the rule's http handlers learned (handler.Metrics.LearnedRate); nil: none
	quotas   *worker.QuotaCollector    // nil: the quotas' windows only
	failures failureLog

	mu     sync.Mutex
	source rulesSource
}

// rulesSource is the rules in force and where they came from.
type rulesSource struct {
	cfg      *rules.Config
	handlers *handler.Config
	loaded   time.Time // when the file was read, at start or at the last reload
	reloads  int       // reloads applied since start
	refused  time.Time // the last reload refused (the running rules stayed); zero if none
	refusal  string    // why
}

// newStatus returns the status of a worker started with cfg and hs;
// learned, if not nil, gives the upstream rate a rule's http handlers
// learned (handler.Metrics.LearnedRate).
func newStatus(cfg *rules.Config, hs *handler.Config, activity *worker.Activity, learned func(rule string) float64) *status {
	now := time.Now()
	return &status{started: now, activity: activity, learned: learned, source: rulesSource{cfg: cfg, handlers: hs, loaded: now}}
}

// reloaded records that a reload put cfg and hs in force.
func (s *status) reloaded(cfg *rules.Config, hs *handler.Config) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.source.cfg, s.source.handlers, s.source.loaded = cfg, hs, time.Now()
	s.source.reloads++
}

// refused records a reload that failed: the running rules stay.
func (s *status) refused(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.source.refused, s.source.refusal = time.Now(), err.Error()
}

// rules returns the rules in force and their source.
func (s *status) rules() rulesSource {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.source
}

// maxRefresh bounds ?refresh=N, the seconds between reloads of the page.
const maxRefresh = 3600

// ServeHTTP serves the page; ?refresh=N (1 to 3600) has the browser load
// it again every N seconds.
func (s *status) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	v := s.view(time.Now())
	if n, err := strconv.Atoi(r.URL.Query().Get("refresh")); err == nil && n >= 1 && n <= maxRefresh {
		v.Refresh = n
	}
	var b bytes.Buffer
	if err := statusTemplate.Execute(&b, v); err != nil {
		http.Error(w, "worker: rendering the status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(b.Bytes())
}

// statusView is what the template shows.
type statusView struct {
	Now, Started time.Time
	Uptime       string
	PID          int
	Host         string
	Refresh      int // seconds; 0: no reload
	File         string
	Prefix       string
	FailOpen     bool
	Loaded       time.Time
	Reloads      int
	Refused      time.Time // zero if no reload was refused
	Refusal      string
	Rules        []ruleView
	Handlers     []handlerView
	Failures     []failure // newest first
	FailureCount int64     // since start
	Span, Ahead  string    // the plots' spans: "5m", "1m"
}

// ruleView is one rule on the page.
type ruleView struct {
	Name     string
	FileLine int // where the rule starts in the file
	ruleWords
	Decisions  []outcomeCount // every outcome, in a fixed order
	Admitted   int64
	LastMinute int      // tasks admitted in the last 60 s
	Uses       []string // each limit's use, in words (limitUse); none for a concurrency limit
	TurnsAhead int
	NextTurn   string // "within 1s", "in 12s"; "" if no turn is ahead
	LastTurn   string
	InLine     int    // tasks waiting in the lines this process serves (jobthrottle_line_waiting)
	Learned    string // "learned: 1.9/s" from the upstream of the rule's http handlers; "" if none
	Plot       plot
}

// outcomeCount is one outcome's count of a rule's decisions.
type outcomeCount struct {
	Outcome string
	Count   int64
}

// outcomes are the decisions' outcomes in the order the page lists them.
var outcomes = []string{admission.LabelAdmitted, admission.LabelWaited, admission.LabelRedeemed, admission.LabelParked,
	admission.LabelDeferred, admission.LabelRefunded, admission.LabelError}

// handlerView is one handler of the rules file.
type handlerView struct {
	Task, Does, Rule string
	Line             int
}

// view is the page at now.
func (s *status) view(now time.Time) statusView {
	src := s.rules()
	host, _ := os.Hostname()
	v := statusView{Now: now, Started: s.started, Uptime: now.Sub(s.started).Round(time.Second).String(), PID: os.Getpid(), Host: host,
		File: src.cfg.File, Prefix: src.cfg.Prefix, FailOpen: src.cfg.FailOpen, Loaded: src.loaded, Reloads: src.reloads, Refused: src.refused, Refusal: src.refusal,
		Span: worker.ActivitySpan.String(), Ahead: worker.ActivityAhead.String()}
	quotas := s.readQuotas()
	for _, r := range src.cfg.Rules {
		rv := ruleOnPage(r, s.activity.Rule(r.Name), quotas, now)
		if s.learned != nil {
			rv.Learned = learnedWords(s.learned(r.Name))
		}
		v.Rules = append(v.Rules, rv)
	}
	for _, h := range src.handlers.Handlers {
		hv := handlerView{Task: h.Task, Does: h.Describe(), Line: h.Line}
		if rc, ok := src.cfg.RuleFor(h.Task); ok {
			hv.Rule = rc.Name
		}
		v.Handlers = append(v.Handlers, hv)
	}
	v.Failures, v.FailureCount = s.failures.recent()
	return v
}

// quotaPageAge is how old a read of the calendar quotas, by a scrape or
// by the page, the page shows rather than read them again: a page shown
// every second costs one read per quotaPageAge.
const quotaPageAge = 10 * time.Second

// pageQuotas are the calendar quotas as the page shows them: the last
// read of each by rule and limit, or why there is none.
type pageQuotas struct {
	read map[[2]string]worker.Quota // by rule, limit
	err  error                      // why the last read failed; nil if it did not
}

// readQuotas returns the quotas as last read, if within quotaPageAge,
// else as read now; none without a collector.
func (s *status) readQuotas() *pageQuotas {
	if s.quotas == nil {
		return nil
	}
	qs, err := s.quotas.Quotas(quotaPageAge)
	p := &pageQuotas{read: map[[2]string]worker.Quota{}, err: err}
	for _, q := range qs {
		p.read[[2]string{q.Rule, q.Limit}] = q
	}
	return p
}

// quotaWords is what remains of calendar limit l of rule r at now, in
// words, as the page shows it after the limit's window: "remaining 7 of
// 1000 until 2026-11-27 00:00 PST (read from Redis 3s ago)"; a quota per
// payload field says why it is not shown. "" without quotas.
func (p *pageQuotas) quotaWords(r rules.RuleConfig, l throttle.Rule, now time.Time) string {
	if p == nil {
		return ""
	}
	if r.Subject.PayloadField != "" {
		return fmt.Sprintf("; what remains is kept per subject (payload field %q), one quota each, which a worker cannot list: not shown", r.Subject.PayloadField)
	}
	var s string
	if q, ok := p.read[[2]string{r.Name, l.Name}]; ok && q.Read {
		s = fmt.Sprintf("; remaining %d of %d until %s (read from Redis %v ago)", q.Remaining, q.Count,
			q.Resets().Format("2006-01-02 15:04 MST"), max(now.Sub(q.At), 0).Round(time.Second))
	}
	if p.err != nil {
		s += "; what remains could not be read from Redis now: " + p.err.Error()
	}
	return s
}

// ruleOnPage is rule r, with its activity a and its calendar quotas as
// read (nil: not read), as the page shows it at now.
func ruleOnPage(r rules.RuleConfig, a worker.RuleActivity, quotas *pageQuotas, now time.Time) ruleView {
	v := ruleView{Name: r.Name, FileLine: r.Line, ruleWords: describeRule(r), Admitted: a.Admitted(),
		TurnsAhead: a.TurnsAhead, InLine: a.LineWaiting}
	for _, o := range outcomes {
		v.Decisions = append(v.Decisions, outcomeCount{o, a.Decisions[o]})
	}
	for _, s := range a.Seconds[len(a.Seconds)-60:] {
		v.LastMinute += s.Admitted
	}
	perSecond := 0.0 // in tasks: the lowest rate of a limit the plot spans
	for i, l := range r.Limits {
		if l.Algorithm == throttle.Concurrency {
			continue
		}
		if l.Algorithm == throttle.CalendarWindow {
			v.Uses = append(v.Uses, calendarWords(l, now)+" (this machine's clock)"+quotas.quotaWords(r, l, now))
			continue
		}
		cost := r.LimitCost(i)
		v.Uses = append(v.Uses, limitUse(l, a.Seconds, cost))
		rate := float64(l.Limit.Count) / l.Limit.Period.Seconds() / float64(max(cost.Permits, 1))
		if l.Limit.Period <= worker.ActivitySpan && (perSecond == 0 || rate < perSecond) {
			perSecond = rate
		}
	}
	if a.TurnsAhead > 0 {
		v.NextTurn, v.LastTurn = dueIn(a.NextTurn, now), dueIn(a.LastTurn, now)
	}
	v.Plot = plotOf(a, perSecond)
	return v
}

// limitUse is the use of limit l in words, from the seconds of its
// rule's activity: the tasks admitted over its period (at least the last
// minute), against what it allows in that time, "partner: 299 tasks in the
// last 1m0s, 100% of 5 per 1s". A limit whose period is longer than the
// activity keeps is not measured. A task takes cost's permits: one unless
// the rule says otherwise; a cost read from each task's payload is not
// known here.
func limitUse(l throttle.Rule, seconds []worker.SecondActivity, cost rules.CostConfig) string {
	span := time.Duration(len(seconds)) * time.Second
	if l.Limit.Period > span {
		return fmt.Sprintf("%s, %d per %v: its period is longer than the %v this page keeps", l.Name, l.Limit.Count, l.Limit.Period, span)
	}
	window := min(max(l.Limit.Period, time.Minute).Round(time.Second), span)
	n := 0
	for _, s := range seconds[len(seconds)-int(window/time.Second):] {
		n += s.Admitted
	}
	permits := n * max(cost.Permits, 1)
	allowed := float64(l.Limit.Count) * window.Seconds() / l.Limit.Period.Seconds()
	s := fmt.Sprintf("%s: %d tasks in the last %v, %.0f%% of %d per %v", l.Name, n, window, 100*float64(permits)/allowed, l.Limit.Count, l.Limit.Period)
	if cost.PayloadField != "" {
		s += fmt.Sprintf(" (counting a permit a task: the real cost is each task's %q)", cost.PayloadField)
	}
	return s
}

// learnedWords is a learned upstream rate on the page: "learned: 1.9/s"
// (to 3 significant digits), "" for none.
func learnedWords(perSecond float64) string {
	if perSecond <= 0 {
		return ""
	}
	return "learned: " + strconv.FormatFloat(perSecond, 'g', 3, 64) + "/s"
}

// dueIn is when a turn due at at is, from now: "within 1s", else "in 12s".
func dueIn(at, now time.Time) string {
	if d := at.Sub(now); d >= time.Second {
		return "in " + d.Round(time.Second).String()
	}
	return "within 1s"
}
