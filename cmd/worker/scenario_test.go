package main

import (
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/worker"
)

// scenarioRules: a partner API paced at 4/s (burst 1, no waiting in a
// worker slot, so a backlog parks), a failing upstream, a command killed
// at its timeout, and a long command to find running.
const scenarioRules = `rules:
  - {name: partner, tasks: ["partner:*"], subject: {payload_field: account_id}, algorithm: gcra, limit: 4, period: 1s, burst: 1, max_wait: 1ms}
  - {name: reports, tasks: ["report:*", "job:*"], subject: {fixed: all}, algorithm: gcra, limit: 50, period: 1s}
handlers:
  - task: partner:sync
    http: {url: "UPSTREAM/accounts/{account_id}/sync"}
  - task: report:upstream
    http: {url: "UPSTREAM/fail"}
  - task: job:hang
    command: {argv: ["/bin/sh", "-c", "sleep 30"], timeout: 300ms, stop_grace: 100ms}
  - task: job:long
    command: {argv: ["/bin/sh", "-c", "sleep 20"]}
`

// What an operator sees of one worker with a backlog, a failing upstream
// and a command killed at its timeout, all at once (and a long command
// still running at the end): a log line per failed attempt, the attempts
// by outcome on /metrics, explain for a parked, a pending and a running
// task, and the status page in Chromium (its screenshot kept in
// $JOBTHROTTLE_ARTIFACTS when set).
func TestOperatorScenario(t *testing.T) {
	t.Parallel()
	browser := chromium(t)
	w := startPageWorker(t, scenarioRules, http.StatusBadGateway)
	rulesFile, base, log := w.rulesFile, w.base, w.log
	rdb := w.proc.Client(t)
	env := []string{"REDIS_URL=" + w.proc.URL()}

	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	enqueue := func(typ, payload string, opts ...asynq.Option) string {
		info, err := client.Enqueue(asynq.NewTask(typ, []byte(payload)), append(opts, asynq.Retention(time.Hour))...)
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}
	long := enqueue("job:long", `{}`, asynq.MaxRetry(0))
	failing := enqueue("report:upstream", `{}`, asynq.MaxRetry(0))
	hung := enqueue("job:hang", `{}`, asynq.MaxRetry(0))
	pending := enqueue("report:upstream", `{}`, asynq.Queue("nobody-serves-this"))
	var backlog []string
	for range 24 {
		backlog = append(backlog, enqueue("partner:sync", `{"account_id": "acct_1"}`))
	}

	// explain, while the long command runs and the backlog is parked.
	waitState(t, insp, "default", long, asynq.TaskStateActive)
	explain := func(id string, args ...string) worker.Explanation {
		code, stdout, _ := cmdtest.Run(t, env, append([]string{"explain", "--json", "--config", rulesFile, id}, args...)...)
		return decodeExplanationOnly(t, code, stdout)
	}
	// A parked task has a turn ahead, or a place in its subject's line
	// (the backlog's later tasks: turns are booked as the line is served).
	// The one parked furthest ahead, once most of the backlog is parked; if
	// it was woken between the listing and explain (a loaded machine),
	// another.
	var e worker.Explanation
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if tasks, _ := insp.ListRetryTasks("default"); len(tasks) >= len(backlog)/2 {
			if e = explain(tasks[len(tasks)-1].ID); e.Status == worker.StatusParked {
				break
			}
		}
		if time.Now().After(end) {
			t.Fatalf("no partner task found parked within 15s; the last: %+v", e)
		}
	}
	if e.Retried != 0 || e.LastWait == nil || e.LastWait.Rule != "partner" ||
		e.LastWait.Subject != "acct_1" || !e.LastWait.RunsAgainAt.After(e.Now) || e.Rule == nil ||
		!(e.Rule.Turn != nil && e.Rule.Turn.After(e.Now) || e.Rule.InLine && e.Rule.Position >= 1 && e.Rule.Position <= e.Rule.LineLength) {
		t.Errorf("explain of a parked task: %+v, rule %+v, wait %+v; want parked by partner for acct_1, not retried, with a turn or a place in line ahead", e, e.Rule, e.LastWait)
	} else if want := map[bool]string{true: worker.ErrParkedInLine.Error(), false: worker.ErrParked.Error()}[e.Rule.InLine]; e.LastWait.Cause != want {
		t.Errorf("a parked task (in line: %v) says it waited for %q; want %q", e.Rule.InLine, e.LastWait.Cause, want)
	}
	if e := explain(pending, "--queue", "nobody-serves-this"); e.Status != worker.StatusPending || e.Rule == nil || e.Rule.Name != "reports" {
		t.Errorf("explain of a pending task: %+v, rule %+v; want pending under rule reports", e, e.Rule)
	}
	// asynq's servers say what they run every 5s: the worker's pid is
	// known by then.
	for end := time.Now().Add(12 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		e := explain(long)
		if e.Status == worker.StatusRunning && e.Running != nil && e.Running.PID > 0 {
			break
		}
		if e.Status != worker.StatusRunning || time.Now().After(end) {
			t.Errorf("explain of a running task: %+v, running %+v; want running, with its worker's pid", e, e.Running)
			break
		}
	}

	// Every task ends as it should: the backlog completed, the failures
	// archived (no retry left).
	for _, id := range backlog {
		waitState(t, insp, "default", id, asynq.TaskStateCompleted)
	}
	waitState(t, insp, "default", failing, asynq.TaskStateArchived)
	waitState(t, insp, "default", hung, asynq.TaskStateArchived)

	metrics, failedAttempts := scrapeMetrics(t, base+"/metrics")
	if got := metrics["partner"]; got["admitted"]+got["waited"]+got["redeemed"] != int64(len(backlog)) || got["parked"] == 0 {
		t.Errorf("partner's decisions on /metrics %v; want %d tasks admitted, some after parking", got, len(backlog))
	}
	outcomes := attemptOutcomes(t, base+"/metrics")
	if failedAttempts != 2 || outcomes["http_5xx"] != 1 || outcomes["timeout"] != 1 || outcomes["success"] != int64(len(backlog)) {
		t.Errorf("handler attempts by outcome on /metrics %v (%d failed); want 1 http_5xx, 1 timeout, %d successes", outcomes, failedAttempts, len(backlog))
	}
	page := loadStatusPage(t, browser, base+"/status", "operator-scenario.png")
	if page.Failures != 2 || !strings.Contains(page.FailureText, "502") {
		t.Errorf("the status page lists %d failures (%q); want the 2 archived tasks', the upstream's 502 among them", page.Failures, page.FailureText)
	}

	// One log line per failed attempt, naming the task and what failed.
	want := map[string]*regexp.Regexp{
		failing: regexp.MustCompile(`^time=\S+ level=ERROR msg="handler: the task failed and will not be retried; asynq archives it" task_type=report:upstream task_id=` + failing + ` kind=http outcome=http_5xx rule=reports status=502 duration=\S+ retry=false retried=0 max_retry=0 error=`),
		hung:    regexp.MustCompile(`^time=\S+ level=ERROR msg="handler: the task failed and will not be retried; asynq archives it" task_type=job:hang task_id=` + hung + ` kind=command outcome=timeout rule=reports signal=terminated duration=\S+ retry=false .*killed after the timeout of 300ms`),
	}
	for range 2 {
		line := log.waitFor(`^.*msg="handler: the task failed.*$`)[0]
		id := regexp.MustCompile(`task_id=(\S+)`).FindStringSubmatch(line)
		if id == nil || want[id[1]] == nil || !want[id[1]].MatchString(line) {
			t.Errorf("failure line %q; want one for each of %s (http 502) and %s (timeout), as %v", line, failing, hung, want)
			continue
		}
		delete(want, id[1])
	}
}

// attemptOutcomes sums jobthrottle_handler_attempts_total on the worker's
// /metrics at url by outcome.
func attemptOutcomes(t *testing.T, url string) map[string]int64 {
	t.Helper()
	sums := map[string]int64{}
	for _, m := range attemptLine.FindAllStringSubmatch(getBody(t, url), -1) {
		n, _ := strconv.ParseInt(m[2], 10, 64)
		sums[m[1]] += n
	}
	return sums
}

// waitState waits until the task id of queue is in state.
func waitState(t *testing.T, insp *asynq.Inspector, queue, id string, state asynq.TaskState) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		info, err := insp.GetTaskInfo(queue, id)
		if err == nil && info.State == state {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("task %s not %v within 30s: %+v, %v", id, state, info, err)
		}
	}
}
