package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// parseBoth parses a rules file's rules and handlers.
func parseBoth(t *testing.T, body string) (*rules.Config, *handler.Config) {
	t.Helper()
	cfg, err := rules.Parse("rules.yaml", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	hs, err := handler.ParseConfig("rules.yaml", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return cfg, hs
}

// get serves a GET of path on h and returns the answer.
func get(h http.Handler, method, path string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
	return rec
}

// The page is served at / and /status beside /metrics, shows the rules
// in force after a reload, and a reload that was refused.
func TestStatusPageRoutesAndReloads(t *testing.T) {
	cfg, hs := parseBoth(t, "rules:\n  - {name: old, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n")
	st := newStatus(cfg, hs, nil, nil)
	mux := healthMux(prometheus.NewRegistry(), func(context.Context) error { return nil }, st)
	for _, path := range []string{"/", "/status", "/status?refresh=5"} {
		rec := get(mux, http.MethodGet, path)
		if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "text/html; charset=utf-8" || !strings.Contains(rec.Body.String(), `data-rule="old"`) {
			t.Errorf("GET %s: %d %s; want the page with rule old", path, rec.Code, rec.Header().Get("Content-Type"))
		}
		if refresh := strings.Contains(rec.Body.String(), `<meta http-equiv="refresh" content="5">`); refresh != strings.Contains(path, "refresh") {
			t.Errorf("GET %s: refreshes: %v", path, refresh)
		}
	}
	if rec := get(mux, http.MethodGet, "/other"); rec.Code != http.StatusNotFound {
		t.Errorf("GET /other: %d; want 404", rec.Code)
	}
	if rec := get(mux, http.MethodPost, "/status"); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /status: %d; want 405", rec.Code)
	}
	if rec := get(healthMux(prometheus.NewRegistry(), nil, nil), http.MethodGet, "/"); rec.Code != http.StatusNotFound {
		t.Errorf("without a status page, GET /: %d; want 404", rec.Code)
	}

	next, nextHs := parseBoth(t, "rules:\n  - {name: new, tasks: [x], subject: {fixed: s}, algorithm: concurrency, limit: 3, lease: 10s}\n")
	st.reloaded(next, nextHs)
	st.refused(errors.New(`rules.yaml:2: rule "new": limit: "-1" <must be positive>`))
	body := get(mux, http.MethodGet, "/status").Body.String()
	for _, want := range []string{
		`data-rule="new"`,
		"new: concurrency, at most 3 at once, lease 10s",
		"(reloaded by SIGHUP, 1 time since start)",
		`was refused; the rules above stay in force: <span class="err">rules.yaml:2: rule &#34;new&#34;: limit: &#34;-1&#34; &lt;must be positive&gt;</span>`,
		"0 tasks admitted in the last minute.", // a concurrency limit has no rate
	} {
		if !strings.Contains(body, want) {
			t.Errorf("after the reloads, the page lacks %q", want)
		}
	}
	if strings.Contains(body, `data-rule="old"`) {
		t.Error("the page still shows the rule the reload removed")
	}
}

// The page lists a handler's failures, newest first, the last
// failuresKept of them, and not its deferrals nor revoked tasks.
func TestStatusFailures(t *testing.T) {
	cfg, hs := parseBoth(t, "rules:\n  - {name: r, tasks: [\"t:*\"], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n")
	st := newStatus(cfg, hs, nil, nil)
	var next error
	h := st.observe(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return next }))
	for _, err := range []error{nil,
		&admission.ThrottledError{Rule: "r", RetryAt: time.Now()},
		fmt.Errorf("moved: %w", asynq.RevokeTask),
	} {
		next = err
		_ = h.ProcessTask(context.Background(), asynq.NewTask("t:a", nil))
	}
	if got, n := st.failures.recent(); len(got) != 0 || n != 0 {
		t.Fatalf("%d failures recorded (%+v); want none: a success, a deferral, a revoked task", n, got)
	}
	for i := range failuresKept + 5 {
		next = fmt.Errorf("failure %d", i)
		if i == failuresKept+4 {
			next = fmt.Errorf("%s: %w", strings.Repeat("é", maxFailureText), asynq.SkipRetry)
		}
		_ = h.ProcessTask(context.Background(), asynq.NewTask("t:a", nil))
	}
	got, n := st.failures.recent()
	if n != failuresKept+5 || len(got) != failuresKept || got[1].Error != fmt.Sprintf("failure %d", failuresKept+3) || got[len(got)-1].Error != "failure 5" {
		t.Fatalf("%d failures, keeping %d, from %q to %q; want %d, the latest %d, newest first", n, len(got), got[1].Error, got[len(got)-1].Error, failuresKept+5, failuresKept)
	}
	if last := got[0]; last.Rule != "r" || last.Task != "t:a" || last.Retry || len(last.Error) > maxFailureText+len("…") || !strings.HasSuffix(last.Error, "é…") {
		t.Errorf("the last failure %+v; want rule r, type t:a, no retry (SkipRetry), its error cut whole runes short of %d bytes", last, maxFailureText)
	}
	body := get(st, http.MethodGet, "/status").Body.String()
	if !strings.Contains(body, `data-failures="25">25 failed attempts since start; the latest 20, newest first.`) || strings.Count(body, "<tr data-task-id=") != failuresKept {
		t.Errorf("the page does not list the 20 latest of 25 failures:\n%s", body)
	}
}

// The plot spans the activity's seconds, its totals are the seconds' sums,
// and its limit line is at the tightest limit's average rate.
func TestStatusPlot(t *testing.T) {
	cfg, _ := parseBoth(t, `rules:
  - name: r
    tasks: [x]
    subject: {fixed: s}
    limits:
      - {name: second, algorithm: gcra, limit: 10, period: 1s}
      - {name: minute, algorithm: sliding_window, limit: 120, period: 1m}
      - {name: fivemin, algorithm: fixed_window, limit: 300, period: 5m}
      - {name: daily, algorithm: fixed_window, limit: 5000, period: 24h}
    cost: 2
`)
	a := worker.RuleActivity{Rule: "r", Seconds: make([]worker.SecondActivity, 300), Ahead: make([]worker.SecondActivity, 60)}
	a.Seconds[299] = worker.SecondActivity{Admitted: 3, Parked: 4}
	a.Seconds[10] = worker.SecondActivity{Admitted: 1}
	a.Ahead[2] = worker.SecondActivity{Parked: 5}
	v := ruleOnPage(cfg.Rules[0], a, nil, time.Now())
	p := v.Plot
	if p.Sums != [3]int{4, 4, 5} || len(p.Admitted) != 2 || len(p.Parked) != 1 || len(p.Ahead) != 1 {
		t.Fatalf("plot sums %v, bars %d/%d/%d; want 4 admitted, 4 parked, 5 ahead in 2, 1 and 1 bars", p.Sums, len(p.Admitted), len(p.Parked), len(p.Ahead))
	}
	// fivemin is the tightest limit the plot spans, 1 permit a second: 0.5
	// tasks. The top is 7 (the busiest second).
	if p.YMax != 7 || p.LimitY != p.Bottom-0.5*plotHeight/7 || p.Limit != "limit 0.5/s" {
		t.Errorf("top %d, limit at %v (%q); want 7, and 0.5/s at %v", p.YMax, p.LimitY, p.Limit, p.Bottom-0.5*plotHeight/7)
	}
	if stacked := p.Parked[0]; stacked.Y+stacked.H != p.Admitted[1].Y || p.Ahead[0].X != p.NowX+2*plotBar {
		t.Errorf("parked bar %+v not on the admitted %+v, or ahead bar at %v, not 2 s right of now", stacked, p.Admitted[1], p.Ahead[0].X)
	}
	// Over its period, at least a minute; 2 permits a task.
	want := []string{
		"r.second: 3 tasks in the last 1m0s, 1% of 10 per 1s",
		"r.minute: 3 tasks in the last 1m0s, 5% of 120 per 1m0s",
		"r.fivemin: 4 tasks in the last 5m0s, 3% of 300 per 5m0s",
		"r.daily, 5000 per 24h0m0s: its period is longer than the 5m0s this page keeps",
	}
	if !slices.Equal(v.Uses, want) {
		t.Errorf("uses:\n%s\nwant:\n%s", strings.Join(v.Uses, "\n"), strings.Join(want, "\n"))
	}
}

// BenchmarkStatusPage is what serving the page costs, for a rules file of
// 10 rules and a full ring of failures: memory only, no Redis.
func BenchmarkStatusPage(b *testing.B) {
	var body strings.Builder
	body.WriteString("rules:\n")
	for i := range 10 {
		fmt.Fprintf(&body, "  - {name: r%d, tasks: [t%d], subject: {fixed: s}, algorithm: gcra, limit: 10, period: 1s}\n", i, i)
	}
	cfg, err := rules.Parse("rules.yaml", []byte(body.String()))
	if err != nil {
		b.Fatal(err)
	}
	m, _ := worker.NewMetrics(prometheus.NewRegistry())
	st := newStatus(cfg, &handler.Config{}, m.Activity(), nil)
	for range failuresKept {
		st.failures.add(failure{At: time.Now(), Task: "t0", ID: "id", Error: strings.Repeat("x", maxFailureText)})
	}
	req := httptest.NewRequest(http.MethodGet, "/status", nil)
	for b.Loop() {
		st.ServeHTTP(httptest.NewRecorder(), req)
	}
}

// A rule whose http handlers learned an upstream rate says so in its
// source, "learned: N/s"; one that learned none does not; each rule shows
// the tasks waiting in its lines, as worker.RuleActivity.LineWaiting
// (jobthrottle_line_waiting) counts them.
func TestStatusPageLearnedAndLine(t *testing.T) {
	cfg, hs := parseBoth(t, `rules:
  - {name: partner, tasks: [p], subject: {fixed: s}, algorithm: gcra, limit: 100, period: 1s}
  - {name: other, tasks: [o], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
`)
	learned := map[string]float64{"partner": 1.9000190001900019}
	st := newStatus(cfg, hs, nil, func(rule string) float64 { return learned[rule] })
	body := get(st, http.MethodGet, "/status").Body.String()
	partner, other, _ := strings.Cut(body[strings.Index(body, `data-rule="partner"`):], `data-rule="other"`)
	if !strings.Contains(partner, `<span class="learned">learned: 1.9/s</span>`) {
		t.Errorf("rule partner's section does not say learned: 1.9/s:\n%s", partner)
	}
	if strings.Contains(other, "learned:") {
		t.Errorf("rule other learned nothing, but its section says learned:\n%s", other)
	}
	if !strings.Contains(partner, `data-line-waiting="0">0 tasks waiting`) {
		t.Errorf("rule partner's section does not say 0 tasks waiting in line:\n%s", partner)
	}
	a := worker.RuleActivity{Rule: "partner", Seconds: make([]worker.SecondActivity, 300), Ahead: make([]worker.SecondActivity, 60), LineWaiting: 7}
	if v := ruleOnPage(cfg.Rules[0], a, nil, time.Now()); v.InLine != 7 {
		t.Errorf("a rule with 7 tasks in line: InLine %d; want 7", v.InLine)
	}
}

// A rule with a priority shows, on the status page (and so in --check),
// where a task's level comes from and the line's age bound: its max_age,
// or the default of 60 horizons.
func TestStatusPagePriority(t *testing.T) {
	cfg, hs := parseBoth(t, `rules:
  - {name: field, tasks: [f], subject: {fixed: s}, algorithm: gcra, limit: 10, period: 1s, priority: {payload_field: p}}
  - {name: queues, tasks: [q], subject: {fixed: s}, algorithm: gcra, limit: 10, period: 1s, horizon: 2s, priority: {queues: {critical: 2, default: 1}, max_age: 30s}}
  - {name: plain, tasks: [o], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
`)
	body := get(newStatus(cfg, hs, nil, nil), http.MethodGet, "/status").Body.String()
	for rule, want := range map[string]string{
		"field":  `priority from payload field &#34;p&#34; (0-9, higher first), age bound 1m0s (the default): a task that waited that long goes before every task that joined after it`,
		"queues": `horizon 2s; priority from queues critical=2 default=1 (0-9, higher first), age bound 30s: a task`,
	} {
		section := body[strings.Index(body, `data-rule="`+rule+`"`):]
		section, _, _ = strings.Cut(section, "</table>")
		if !strings.Contains(section, want) {
			t.Errorf("rule %s's section does not say %q:\n%s", rule, want, section)
		}
	}
	plain, _, _ := strings.Cut(body[strings.Index(body, `data-rule="plain"`):], "</table>")
	if strings.Contains(plain, "priority") {
		t.Errorf("rule plain has no priority, but its section names one:\n%s", plain)
	}
}
