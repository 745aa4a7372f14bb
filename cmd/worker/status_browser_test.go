package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// envArtifacts names a directory where tests save what a reader may want
// to see (the status page's screenshot); unset, a test's own temporary
// directory, removed after it.
const envArtifacts = "JOBTHROTTLE_ARTIFACTS"

// statusRules are the rules of the status page's test: a rule that parks
// all but one of a burst of tasks, and one whose handlers fail.
const statusRules = `rules:
  - {name: partner, tasks: ["partner:*"], subject: {payload_field: account_id}, algorithm: gcra, limit: 2, period: 1s, burst: 1, max_wait: 1ms}
  - {name: reports, tasks: ["report:*"], subject: {fixed: all}, algorithm: gcra, limit: 10, period: 1s}
handlers:
  - task: partner:sync
    http: {url: "UPSTREAM/accounts/{account_id}/sync"}
  - task: report:upstream
    http: {url: "UPSTREAM/fail"}
  - task: report:crash
    command: {argv: ["/bin/sh", "-c", "exit 3"]}
`

// The status page of a running worker, loaded in a real headless
// Chromium, shows the worker's rules, the same decisions as its /metrics,
// a plot of them, and as many handler failures as /metrics counts: those
// of the tasks asynq archived.
func TestStatusPageInChromium(t *testing.T) {
	t.Parallel()
	browser := chromium(t)
	w := startPageWorker(t, statusRules, http.StatusInternalServerError)
	rulesFile, proc, base := w.rulesFile, w.proc, w.base
	go w.log.rest() // keeps its stderr flowing

	failed := runStatusTasks(t, proc.Client(t))
	metrics, failedAttempts := scrapeMetrics(t, base+"/metrics")
	if failedAttempts != len(failed) {
		t.Errorf("jobthrottle_handler_attempts_total counts %d failed attempts; want the %d archived tasks'", failedAttempts, len(failed))
	}
	if got := metrics["partner"]; got["admitted"]+got["waited"]+got["redeemed"] != 6 || got["parked"] == 0 {
		t.Errorf("partner's decisions on /metrics %v; want 6 tasks admitted, some after parking", got)
	}
	page := loadStatusPage(t, browser, base+"/status", "status-page.png")

	if page.File != rulesFile || len(page.Rules) != 2 || page.Rules[0].Name != "partner" || page.Rules[1].Name != "reports" {
		t.Fatalf("the page shows rules %+v from %q; want partner and reports from %s", page.Rules, page.File, rulesFile)
	}
	if want := []string{"partner: gcra, 2 per 1s, burst 1"}; !slices.Equal(page.Rules[0].Limits, want) {
		t.Errorf("partner's limits on the page %q; want %q", page.Rules[0].Limits, want)
	}
	for _, r := range page.Rules {
		for _, o := range outcomes {
			if got, want := r.Decisions[o], metrics[r.Name][o]; got != want {
				t.Errorf("rule %s, %s: the page says %d, /metrics %d", r.Name, o, got, want)
			}
		}
		m := metrics[r.Name]
		if r.LineWaiting != m["line"] {
			t.Errorf("rule %s: the page says %d tasks in line, jobthrottle_line_waiting %d", r.Name, r.LineWaiting, m["line"])
		}
		if admitted := m["admitted"] + m["waited"] + m["redeemed"]; r.PlotAdmitted != admitted || r.PlotParked != m["parked"] || r.PlotWidth <= 0 {
			t.Errorf("rule %s's plot: %d admitted, %d parked, %v px wide; /metrics says %d and %d", r.Name, r.PlotAdmitted, r.PlotParked, r.PlotWidth, admitted, m["parked"])
		}
	}
	slices.Sort(page.FailedIDs)
	if page.Failures != failedAttempts || !slices.Equal(page.FailedIDs, failed) {
		t.Errorf("the page lists %d failures, of tasks %q; want the %d of /metrics, the tasks archived: %q", page.Failures, page.FailedIDs, failedAttempts, failed)
	}
	if !strings.Contains(page.FailureText, "answered 500 Internal Server Error") || !strings.Contains(page.FailureText, "exited with 3") {
		t.Errorf("the failures' errors %q; want the upstream's 500 and the command's exit code 3", page.FailureText)
	}
}

// pageWorker is a worker binary started for a test of what an operator
// sees: its rules file, its Redis, the base URL of its /metrics and
// /status, and its log.
type pageWorker struct {
	rulesFile string
	proc      *redistest.Proc
	base      string
	log       *binaryLog
}

// startPageWorker starts the worker binary on a fresh Redis with the
// rules file rules, whose UPSTREAM stands for a fake API on loopback
// that answers its /fail with failStatus and everything else with 200,
// and waits until it processes tasks.
func startPageWorker(t *testing.T, rules string, failStatus int) pageWorker {
	t.Helper()
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fail" {
			http.Error(w, "upstream down", failStatus)
		}
	}))
	t.Cleanup(upstream.Close)
	w := pageWorker{rulesFile: writeRules(t, strings.ReplaceAll(rules, "UPSTREAM", upstream.URL)), proc: redistest.Server(t)}
	_, w.log = startBinary(t, []string{"REDIS_URL=" + w.proc.URL()}, "--config", w.rulesFile, "--metrics-addr", "127.0.0.1:0", "--concurrency", "4", "--shutdown-timeout", "2s")
	w.base = w.log.waitFor(`url=(http://\S+)/metrics`)[1]
	w.log.waitFor(`msg="worker: processing"`)
	return w
}

// getBody returns the body of a GET of url.
func getBody(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

// chromium returns the path of Debian's chromium, or skips the test
// without one (fails it in CI, where scripts/test.sh installs it).
func chromium(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		msg := "chromium not found in PATH; install Debian's chromium package, or run bash scripts/test.sh, which does"
		if os.Getenv("CI") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return path
}

// runStatusTasks enqueues 6 tasks of rule partner, for one account (all
// but the first park), and 3 of rule reports whose handlers fail without a
// retry left (archived), waits until every one is done, and returns the
// sorted IDs of the failed ones.
func runStatusTasks(t *testing.T, rdb redis.UniversalClient) []string {
	t.Helper()
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	enqueue := func(typ, payload string, opts ...asynq.Option) string {
		info, err := client.Enqueue(asynq.NewTask(typ, []byte(payload)), append(opts, asynq.Retention(time.Hour))...)
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}
	want := map[string]asynq.TaskState{}
	for range 6 {
		want[enqueue("partner:sync", `{"account_id": "acct_1"}`)] = asynq.TaskStateCompleted
	}
	var failed []string
	for _, typ := range []string{"report:upstream", "report:upstream", "report:crash"} {
		id := enqueue(typ, `{}`, asynq.MaxRetry(0))
		want[id] = asynq.TaskStateArchived
		failed = append(failed, id)
	}
	for id, state := range want {
		for end := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			info, err := insp.GetTaskInfo("default", id)
			if err == nil && info.State == state {
				break
			}
			if time.Now().After(end) {
				t.Fatalf("task %s not %v within 30s: %+v, %v", id, state, info, err)
			}
		}
	}
	slices.Sort(failed)
	return failed
}

// decisionLine is a sample of jobthrottle_decisions_total in the text
// format (labels in name order); attemptLine one of
// jobthrottle_handler_attempts_total; lineWaitingLine one of
// jobthrottle_line_waiting.
var (
	decisionLine    = regexp.MustCompile(`(?m)^jobthrottle_decisions_total\{outcome="(\w+)",rule="([^"]+)"\} (\d+)$`)
	lineWaitingLine = regexp.MustCompile(`(?m)^jobthrottle_line_waiting\{rule="([^"]+)"\} (\d+)$`)
	attemptLine     = regexp.MustCompile(`(?m)^jobthrottle_handler_attempts_total\{handler="[^"]+",kind="\w+",outcome="(\w+)"\} (\d+)$`)
)

// scrapeMetrics returns the decisions on the worker's /metrics at url, by
// rule and outcome (and under "line", the rule's jobthrottle_line_waiting),
// and the handlers' failed attempts: every outcome but success and
// throttled (a deferral).
func scrapeMetrics(t *testing.T, url string) (map[string]map[string]int64, int) {
	t.Helper()
	body := getBody(t, url)
	decisions := map[string]map[string]int64{}
	for _, m := range decisionLine.FindAllStringSubmatch(body, -1) {
		if decisions[m[2]] == nil {
			decisions[m[2]] = map[string]int64{}
		}
		decisions[m[2]][m[1]], _ = strconv.ParseInt(m[3], 10, 64)
	}
	// The tasks in line, as the decision "line" of their rule.
	for _, m := range lineWaitingLine.FindAllStringSubmatch(string(body), -1) {
		if decisions[m[1]] == nil {
			decisions[m[1]] = map[string]int64{}
		}
		decisions[m[1]]["line"], _ = strconv.ParseInt(m[2], 10, 64)
	}
	failed := 0
	for _, m := range attemptLine.FindAllStringSubmatch(body, -1) {
		if n, _ := strconv.Atoi(m[2]); m[1] != "success" && m[1] != "throttled" {
			failed += n
		}
	}
	return decisions, failed
}

// statusPage is what the test reads of the page in the browser.
type statusPage struct {
	File  string `json:"file"`
	Rules []struct {
		Name         string           `json:"name"`
		Limits       []string         `json:"limits"`
		Decisions    map[string]int64 `json:"decisions"`
		PlotAdmitted int64            `json:"plotAdmitted"`
		PlotParked   int64            `json:"plotParked"`
		PlotWidth    float64          `json:"plotWidth"`
		LineWaiting  int64            `json:"lineWaiting"`
	} `json:"rules"`
	Failures    int      `json:"failures"`
	FailedIDs   []string `json:"failedIDs"`
	FailureText string   `json:"failureText"`
}

// readStatusPage reads the page's rules, decisions, plots (their totals,
// and their rendered width) and failures, as shown.
const readStatusPage = `(() => {
	const rules = [...document.querySelectorAll("section.rule")].map(s => {
		const svg = s.querySelector("svg.plot");
		return {
			name: s.dataset.rule,
			limits: [...s.querySelectorAll("td.limit")].map(td => td.textContent),
			decisions: Object.fromEntries([...s.querySelectorAll("td[data-outcome]")].map(td => [td.dataset.outcome, Number(td.textContent)])),
			plotAdmitted: Number(svg.dataset.admitted),
			plotParked: Number(svg.dataset.parked),
			plotWidth: svg.getBoundingClientRect().width,
			lineWaiting: Number(s.querySelector("td[data-line-waiting]").dataset.lineWaiting),
		};
	});
	const failed = [...document.querySelectorAll("#failures tr[data-task-id]")];
	return {
		file: document.querySelector("#rules-file").textContent,
		rules,
		failures: Number(document.querySelector("#failure-count").dataset.failures),
		failedIDs: failed.map(tr => tr.dataset.taskId),
		failureText: failed.map(tr => tr.querySelector(".err").textContent).join("\n"),
	};
})()`

// loadStatusPage loads the page at url in a headless browser (the
// chromium at path), reads it, and saves a screenshot of it as shot (a
// PNG file's name) in $JOBTHROTTLE_ARTIFACTS, or else the test's
// temporary directory.
func loadStatusPage(t *testing.T, path, url, shot string) statusPage {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.WindowSize(1000, 800))
	ctx, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	ctx, cancelTab := chromedp.NewContext(ctx)
	defer cancelTab()
	if err := chromedp.Do(ctx, chromedp.Navigate(url), chromedp.WaitVisible(chromedp.CSS("#failure-count"))); err != nil {
		t.Fatalf("loading %s in chromium: %v", url, err)
	}
	page, err := chromedp.Run(ctx, chromedp.Evaluate[statusPage](readStatusPage))
	if err != nil {
		t.Fatalf("reading the page: %v", err)
	}
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	dir := os.Getenv(envArtifacts)
	if dir == "" {
		dir = t.TempDir()
	}
	file := filepath.Join(dir, shot)
	if err := os.WriteFile(file, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot of the status page: %s (%d bytes)", file, len(png))
	return page
}
