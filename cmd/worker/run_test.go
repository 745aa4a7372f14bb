package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// logBuffer collects the worker's log safely across goroutines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// find waits for re to match the log and returns its first group.
func (l *logBuffer) find(t *testing.T, re string) string {
	t.Helper()
	rx := regexp.MustCompile(re)
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if m := rx.FindStringSubmatch(l.String()); m != nil {
			return m[len(m)-1]
		}
	}
	t.Fatalf("log never matched %s:\n%s", re, l.String())
	return ""
}

// start runs the worker with args until the test ends, and returns its
// log, a function that stops it (gracefully: its context ends) and returns
// what run returned, and the channel of the signals it gets.
func start(t *testing.T, env map[string]string, args ...string) (*logBuffer, func() error, chan<- os.Signal) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	log := &logBuffer{}
	signals := make(chan os.Signal, 4)
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, func(k string) string { return env[k] }, io.Discard, log, signals) }()
	var once sync.Once
	var runErr error
	stop := func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(20 * time.Second):
				t.Errorf("the worker did not stop within 20s:\n%s", log.String())
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return log, stop, signals
}

func writeRules(t *testing.T, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func waitCompleted(t *testing.T, insp *asynq.Inspector, queue, id string) *asynq.TaskInfo {
	t.Helper()
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		info, err := insp.GetTaskInfo(queue, id)
		if err == nil && info.State == asynq.TaskStateCompleted {
			return info
		}
		if time.Now().After(end) {
			t.Fatalf("task %s not completed: %+v, %v", id, info, err)
		}
	}
}

func TestRunWithRedisAndRules(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rules := writeRules(t, `
prefix: "`+redistest.Prefix(t)+`"
rules:
  - name: echo
    tasks: ["demo:echo"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 10
    period: 1s
    burst: 1
    max_wait: 5s
  - {name: quota, tasks: ["quota:*"], subject: {fixed: all}, algorithm: calendar, limit: 1000, period: day@UTC}
handlers:
  - {task: "job:fail", command: {argv: [sh, -c, "exit 3"]}}
`)
	log, stop, _ := start(t, map[string]string{"REDIS_URL": proc.URL()},
		"--config", rules, "--demo", "--concurrency", "4", "--queues", "critical=2,default=1", "--metrics-addr", "127.0.0.1:0", "--shutdown-timeout", "2s")
	metricsURL := log.find(t, `url=(http://\S+/metrics)`)
	log.find(t, `worker: processing`)

	rdb := proc.Client(t)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	// Enqueued while the queue is paused, so that the three come at once.
	if err := insp.PauseQueue("critical"); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for range 3 {
		info, err := client.Enqueue(asynq.NewTask(TypeEcho, []byte(`{"tenant": "acme", "message": "hi"}`)), asynq.Queue("critical"), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.ID)
	}
	if err := insp.UnpauseQueue("critical"); err != nil {
		t.Fatal(err)
	}
	api, err := client.Enqueue(asynq.NewTask(TypeAPI, []byte(`{"account_id": "acct_42"}`)), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	var turns []time.Time
	for _, id := range ids {
		info := waitCompleted(t, insp, "critical", id)
		var res struct {
			Message string    `json:"message"`
			Turn    time.Time `json:"turn"`
		}
		if err := json.Unmarshal(info.Result, &res); err != nil || res.Message != "hi" || res.Turn.IsZero() {
			t.Errorf("echo result %s: %v; want the message and the task's turn", info.Result, err)
		}
		turns = append(turns, res.Turn)
	}
	// Three tasks at once under 10/s, burst 1: their turns (on the Redis
	// clock), whether they waited in their slots or parked, are 100ms apart.
	slices.SortFunc(turns, time.Time.Compare)
	if span := turns[2].Sub(turns[0]); span < 200*time.Millisecond-time.Millisecond {
		t.Errorf("three turns at 10/s, burst 1, span %v; want 200ms", span)
	}
	if info := waitCompleted(t, insp, "default", api.ID); !bytes.Contains(info.Result, []byte(`"path": "/v1/accounts/acct_42"`)) {
		t.Errorf("api result %s", info.Result)
	}
	// A failing command, on its only try: one line at Error, counted.
	failing, err := client.Enqueue(asynq.NewTask("job:fail", nil), asynq.MaxRetry(0))
	if err != nil {
		t.Fatal(err)
	}
	log.find(t, `level=ERROR msg="handler: the task failed and will not be retried; asynq archives it" task_type=job:fail task_id=`+failing.ID+` kind=command outcome=exit_nonzero exit_code=3 duration=\S+ retry=false retried=0 max_retry=0 error=`)
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if info, err := insp.GetTaskInfo("default", failing.ID); err == nil && info.State == asynq.TaskStateArchived {
			break
		}
		if time.Now().After(end) {
			t.Fatal("the failing task was not archived")
		}
	}

	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`jobthrottle_decisions_total{outcome="waited",rule="echo"}`, `jobthrottle_wait_seconds_bucket{rule="echo"`, `jobthrottle_waiters{rule="echo"} 0`, `go_goroutines`,
		`jobthrottle_handler_attempts_total{handler="job:fail",kind="command",outcome="exit_nonzero"} 1`,
		`jobthrottle_handler_attempts_total{handler="job:fail",kind="command",outcome="success"} 0`,
		`jobthrottle_handler_duration_seconds_count{handler="job:fail",kind="command"} 1`,
		`jobthrottle_queue_tasks{queue="critical",state="completed"} 3`, `jobthrottle_queue_tasks{queue="default",state="completed"} 1`,
		`jobthrottle_queue_tasks{queue="default",state="archived"} 1`, `jobthrottle_queue_read_errors_total 0`, `jobthrottle_wakeup_ledger_members `,
		// the day's quota, untouched, read on the real Redis
		`jobthrottle_quota_remaining{limit="quota",rule="quota"} 1000`, `jobthrottle_quota_reset_seconds{limit="quota",rule="quota"} `, `jobthrottle_quota_read_errors_total 0`,
		// what reached Redis for jobthrottle: the decisions' script, the ledger's look
		`jobthrottle_redis_calls_total{call="admit",kind="script"} `, `jobthrottle_redis_calls_total{call="wake_pop",kind="script"} `} {
		if !bytes.Contains(body, []byte(want)) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if bytes.Contains(body, []byte("acme")) {
		t.Error("a subject appears in the metrics")
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v\n%s", err, log)
	}
	if !strings.Contains(log.String(), "worker: stopped") {
		t.Errorf("no graceful stop in the log:\n%s", log)
	}
}

func TestRunEmbeddedRedis(t *testing.T) {
	t.Parallel()
	log, stop, _ := start(t, nil, "--shutdown-timeout", "1s")
	url := log.find(t, `url=(redis://127\.0\.0\.1:\d+/0)`)
	first, _, _ := strings.Cut(log.String(), "\n")
	if !strings.Contains(first, "in-memory Redis") || !strings.Contains(first, url) {
		t.Errorf("the first log line does not announce the in-memory Redis and its URL: %s", first)
	}
	log.find(t, `worker: processing`)
	if !strings.Contains(log.String(), "built-in demo rules") {
		t.Error("no word that the built-in demo rules are used")
	}

	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	info, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask(TypeEcho, []byte(`{"tenant": "t1", "message": "from another process"}`)), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if got := waitCompleted(t, asynq.NewInspectorFromRedisClient(rdb), "default", info.ID); !bytes.Contains(got.Result, []byte("from another process")) {
		t.Errorf("result %s", got.Result)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

func TestRunBadRules(t *testing.T) {
	t.Parallel()
	rules := writeRules(t, "rules:\n  - name: stripe\n    tasks: [\"stripe:*\"]\n    subject: {payload_field: account_id}\n    algorithm: gcra\n    limit: 20\n    period: 0s\n")
	var log bytes.Buffer
	err := run(context.Background(), []string{"--config", rules}, func(string) string { return "" }, io.Discard, &log, nil)
	want := rules + `:7: rule "stripe": period: "0s" must be at least 1µs`
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want %s", err, want)
	}
	if strings.Contains(log.String(), "in-memory Redis") {
		t.Error("started a Redis before checking the rules")
	}
}

func TestRunHidesRedisPassword(t *testing.T) {
	t.Parallel()
	// A port nothing listens on.
	srv := httptest.NewServer(http.NotFoundHandler())
	addr := srv.Listener.Addr().String()
	srv.Close()
	var log bytes.Buffer
	err := run(context.Background(), []string{"--redis", "redis://app:hunter2@" + addr + "/0"}, func(string) string { return "" }, io.Discard, &log, nil)
	if err == nil {
		t.Fatal("run succeeded without Redis")
	}
	for _, s := range []string{err.Error(), log.String()} {
		if strings.Contains(s, "hunter2") {
			t.Errorf("the password shows: %s", s)
		}
		if !strings.Contains(s, "redis://app:xxxxx@"+addr) {
			t.Errorf("the redacted URL does not show: %s", s)
		}
	}
}

func TestParseFlags(t *testing.T) {
	env := map[string]string{"REDIS_URL": "redis://env:6379", "JOBTHROTTLE_CONFIG": "env.yaml", "JOBTHROTTLE_METRICS_ADDR": ":9999"}
	o, err := parseFlags([]string{"--config", "flag.yaml"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.redisURL != "redis://env:6379" || o.config != "flag.yaml" || o.metricsAddr != ":9999" || o.queues["default"] != 1 || o.wakeupShards != 3 {
		t.Errorf("options %+v", o)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--queues", "critical=0"}, `-queues: "critical=0": the priority must be a whole number of at least 1`},
		{[]string{"--queues", "=3"}, `-queues: "=3": missing queue name`},
		{[]string{"--queues", "a,a=2"}, `-queues: queue "a" is listed twice`},
		{[]string{"--queues", " , "}, `-queues: no queue given`},
		{[]string{"--log-level", "loud"}, `-log-level "loud": use debug, info, warn or error`},
		{[]string{"--log-format", "xml"}, `-log-format "xml": use text or json`},
		{[]string{"--concurrency", "-1"}, `-concurrency -1: must be 0`},
		{[]string{"--shutdown-timeout", "0s"}, `-shutdown-timeout 0s: must be positive`},
		{[]string{"extra"}, `unexpected argument "extra"`},
		{[]string{"--wakeup-shards", "0"}, `-wakeup-shards 0: must be between 1 and 64`},
		{[]string{"--wakeup-shards", "65"}, `-wakeup-shards 65: must be between 1 and 64`},
	} {
		if _, err := parseFlags(tc.args, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: got %v, want %q", tc.args, err, tc.want)
		}
	}
	q, err := parseQueues("critical=6, default=3,low")
	if err != nil || q["critical"] != 6 || q["default"] != 3 || q["low"] != 1 || len(q) != 3 {
		t.Errorf("parseQueues = %v, %v", q, err)
	}
}

func TestFakeAPI(t *testing.T) {
	srv := httptest.NewServer(fakeAPI(2))
	defer srv.Close()
	// Align to the start of a second so that three requests share one.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second)))
	var codes []int
	for range 3 {
		resp, err := http.Get(srv.URL + "/v1/x")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") != "1" {
			t.Error("429 without Retry-After: 1")
		}
	}
	if codes[0] != 200 || codes[1] != 200 || codes[2] != 429 {
		t.Errorf("codes %v, want 200 200 429", codes)
	}
}

// A worker with a rules file serves no demo: no stand-in API listens, and
// a demo:echo task finds no handler. (--demo, or no rules file, serves it:
// TestRunWithRedisAndRules, TestRunEmbeddedRedis.)
func TestRunNoDemoWithRules(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rules := writeRules(t, `prefix: "`+redistest.Prefix(t)+`"
rules:
  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
`)
	log, stop, _ := start(t, map[string]string{"REDIS_URL": proc.URL()}, "--config", rules, "--shutdown-timeout", "1s")
	log.find(t, `worker: processing`)
	rdb := proc.Client(t)
	info, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask(TypeEcho, []byte(`{"tenant": "t", "message": "hi"}`)), asynq.MaxRetry(0), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for end := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		got, err := insp.GetTaskInfo("default", info.ID)
		if err == nil && got.State == asynq.TaskStateArchived {
			if !strings.Contains(got.LastErr, "handler not found") {
				t.Errorf("demo:echo archived with %q; want no handler found", got.LastErr)
			}
			break
		}
		if time.Now().After(end) {
			t.Fatalf("demo:echo not archived: %+v, %v", got, err)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(log.String(), "demo:") {
		t.Errorf("the demo shows in the log of a worker with rules:\n%s", log)
	}
}

// JSON logs write durations as Go writes them, not in nanoseconds.
func TestRunJSONDurations(t *testing.T) {
	t.Parallel()
	log, stop, _ := start(t, nil, "--log-format", "json") // the default --shutdown-timeout, 10s
	log.find(t, `worker: processing`)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), `"shutdown_timeout":"10s"`) {
		t.Errorf("no \"shutdown_timeout\":\"10s\" in the log:\n%s", log)
	}
	for line := range strings.Lines(log.String()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Errorf("not a JSON line: %s", line)
		}
	}
}

// A reload that finds a ${VAR} unset keeps the running rules, and says
// that the variable must be set where the worker starts: a reload cannot
// change the environment.
func TestRunReloadUnsetVariable(t *testing.T) {
	t.Parallel()
	const rule = "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n"
	path := writeRules(t, rule)
	log, stop, signals := start(t, nil, "--config", path, "--shutdown-timeout", "1s")
	log.find(t, `worker: processing`)
	if err := os.WriteFile(path, []byte(rule+"handlers:\n  - task: x\n    http: {url: \"https://api.example/v1\", headers: {Authorization: \"Bearer ${RELOAD_TOKEN}\"}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	signals <- syscall.SIGHUP
	line := log.find(t, `(level=ERROR msg="worker: rules file not reloaded; the running rules stay" .*)`)
	want := regexp.QuoteMeta(path) + `:4: handler for \\"x\\": header Authorization: environment variable RELOAD_TOKEN is not set, and a reload cannot change the environment the worker started with: set RELOAD_TOKEN where the worker starts, then restart it`
	if !regexp.MustCompile(want).MatchString(line) {
		t.Errorf("reload error:\n%s\nwant it to match %s", line, want)
	}
	if strings.Contains(line, "set it in the worker's environment") {
		t.Errorf("the reload error tells to set the variable in the running worker's environment:\n%s", line)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
