package handler_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// upstream is a loopback API that counts requests per item: it answers
// 429 with Retry-After to everything for pauseFor after the first request,
// 400 to the item "bad", 500 then 200 to the item "flaky", 200 otherwise.
type upstream struct {
	mu         sync.Mutex
	pauseFor   time.Duration
	firstAt    time.Time // the first request: the 429s start
	pauseUntil time.Time
	tooMany    int                 // 429 answers
	answered   map[string][]int    // item -> statuses other than 429
	during     []time.Time         // requests received during the pause
	keys       map[string]struct{} // X-Api-Key values seen
	queries    map[string]string   // item -> mode query value
	bodies     map[string]string   // item -> request body
	paths      map[string]struct{} // raw paths seen
}

func newUpstream(pauseFor time.Duration) *upstream {
	return &upstream{pauseFor: pauseFor, answered: map[string][]int{}, keys: map[string]struct{}{},
		queries: map[string]string{}, bodies: map[string]string{}, paths: map[string]struct{}{}}
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	item := strings.TrimPrefix(r.URL.Path, "/v1/items/")
	body, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	defer u.mu.Unlock()
	u.keys[r.Header.Get("X-Api-Key")] = struct{}{}
	u.paths[r.URL.EscapedPath()] = struct{}{}
	if u.firstAt.IsZero() {
		u.firstAt, u.pauseUntil = now, now.Add(u.pauseFor)
	}
	if now.Before(u.pauseUntil) {
		u.during = append(u.during, now)
		u.tooMany++
		w.Header().Set("Retry-After", fmt.Sprint(int(u.pauseUntil.Sub(now).Seconds()+0.999)))
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}
	u.queries[item] = r.URL.Query().Get("mode")
	u.bodies[item] = string(body)
	status := http.StatusOK
	switch {
	case item == "bad":
		status = http.StatusBadRequest
	case item == "flaky" && len(u.answered[item]) == 0:
		status = http.StatusInternalServerError
	}
	u.answered[item] = append(u.answered[item], status)
	w.WriteHeader(status)
	switch status {
	case http.StatusOK:
		fmt.Fprintf(w, `{"item": %q, "padding": "%s"}`, item, strings.Repeat("x", 100))
	case http.StatusBadRequest:
		fmt.Fprintf(w, `{"error": "invalid item %s"}`, item)
	default:
		fmt.Fprint(w, "oops")
	}
}

// fleet starts n asynq servers on rdb with the rules' middleware and
// handlers: n worker processes.
func fleet(t *testing.T, rdb redis.UniversalClient, rulesFile string, n, concurrency int, getenv func(string) string) {
	t.Helper()
	cfg, err := rules.Parse("rules.yaml", []byte(rulesFile))
	if err != nil {
		t.Fatal(err)
	}
	hs, err := handler.ParseConfig("rules.yaml", []byte(rulesFile))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for range n {
		mw, err := worker.FromRules(cfg, rdb, worker.Options{Logger: log, Asynq: rdb})
		if err != nil {
			t.Fatal(err)
		}
		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		if err := hs.Register(mux, handler.Options{Rules: cfg, Redis: rdb, Getenv: getenv, Logger: log, SetCost: worker.SetCost, SetCosts: worker.SetCosts}); err != nil {
			t.Fatal(err)
		}
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
			Concurrency: concurrency,
			Queues:      map[string]int{"default": 1},
			// Real failures retry after a second here, not asynq's minutes.
			RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
			Logger:         worker.AsynqLogger(log),
			LogLevel:       asynq.ErrorLevel,
		}))
		if err := srv.Start(mux); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Stop(); mw.Drain(); srv.Shutdown() })
	}
}

// settle waits until every task is completed or archived, and returns
// their infos by ID.
func settle(t *testing.T, insp *asynq.Inspector, ids []string, within time.Duration) map[string]*asynq.TaskInfo {
	t.Helper()
	end := time.Now().Add(within)
	for {
		infos := map[string]*asynq.TaskInfo{}
		for _, id := range ids {
			info, err := insp.GetTaskInfo("default", id)
			if err == nil && (info.State == asynq.TaskStateCompleted || info.State == asynq.TaskStateArchived) {
				infos[id] = info
			}
		}
		if len(infos) == len(ids) {
			return infos
		}
		if time.Now().After(end) {
			for _, id := range ids {
				info, err := insp.GetTaskInfo("default", id)
				if err == nil {
					t.Logf("task %s: %v retried %d: %s", id, info.State, info.Retried, info.LastErr)
				}
			}
			t.Fatalf("%d of %d tasks settled within %v", len(infos), len(ids), within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// An http rule end to end, on a real Redis with two asynq servers: 2xx
// completes with the cut response as the result, 429 pauses the whole
// fleet and defers without a failure, 400 archives at once with the
// status and body, 500 retries; every task ends once, none is lost.
func TestHTTPHandlerEndToEnd(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	up := newUpstream(2 * time.Second)
	api := httptest.NewServer(up)
	t.Cleanup(api.Close)

	rules := fmt.Sprintf(`
prefix: %q
rules:
  - name: partner
    tasks: ["partner:call"]
    subject: {fixed: partner}
    algorithm: gcra
    limit: 40
    period: 1s
    burst: 4
    max_wait: 1s
handlers:
  - task: partner:call
    result_limit: 20
    http:
      method: POST
      url: "%s/v1/items/{item}?mode={mode}"
      headers: {X-Api-Key: "k-${TEST_API_KEY}"}
      timeout: 2s
`, redistest.Prefix(t), api.URL)
	env := map[string]string{"TEST_API_KEY": "s3cret"}
	fleet(t, rdb, rules, 2, 4, func(k string) string { return env[k] })

	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	items := []string{"bad", "flaky", "a/b c", "ümlaut"}
	for i := range 16 {
		items = append(items, fmt.Sprintf("item-%d", i))
	}
	byID := map[string]string{}
	var ids []string
	for _, item := range items {
		payload, _ := json.Marshal(map[string]any{"item": item, "mode": "full&x=1"})
		info, err := client.Enqueue(asynq.NewTask("partner:call", payload), asynq.MaxRetry(3), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		byID[info.ID] = item
		ids = append(ids, info.ID)
	}
	infos := settle(t, insp, ids, 40*time.Second)

	up.mu.Lock()
	defer up.mu.Unlock()
	for id, info := range infos {
		item := byID[id]
		statuses := up.answered[item]
		switch item {
		case "bad":
			if info.State != asynq.TaskStateArchived || info.Retried != 0 ||
				!strings.Contains(info.LastErr, "400 Bad Request") || !strings.Contains(info.LastErr, "invalid item bad") {
				t.Errorf("bad: %v retried %d, last error %q; want archived at once with the status and body", info.State, info.Retried, info.LastErr)
			}
			if len(statuses) != 1 {
				t.Errorf("bad: the upstream answered %v; want one 400", statuses)
			}
		case "flaky":
			if info.State != asynq.TaskStateCompleted || info.Retried != 1 || fmt.Sprint(statuses) != "[500 200]" {
				t.Errorf("flaky: %v retried %d, upstream answered %v; want completed after one retry, 500 then 200", info.State, info.Retried, statuses)
			}
		default:
			want := fmt.Sprintf(`{"item": %q, "padding": "xxx`, item)[:20]
			if info.State != asynq.TaskStateCompleted || info.Retried != 0 || string(info.Result) != want {
				t.Errorf("%s: %v retried %d result %q; want completed, no failure counted, result %q", item, info.State, info.Retried, info.Result, want)
			}
			if len(statuses) != 1 {
				t.Errorf("%s: the upstream answered %v; want exactly one 200 (none lost, none run twice)", item, statuses)
			}
		}
		if item != "bad" && item != "flaky" && up.queries[item] != "full&x=1" {
			t.Errorf("%s: the query value arrived as %q", item, up.queries[item])
		}
	}
	if _, ok := up.paths["/v1/items/a%2Fb%20c"]; !ok {
		t.Errorf("the path value \"a/b c\" was not escaped as one segment: %v", up.paths)
	}
	if len(up.keys) != 1 {
		t.Errorf("X-Api-Key values %v; want only the one from the environment", up.keys)
	}
	if _, ok := up.keys["k-s3cret"]; !ok {
		t.Errorf("X-Api-Key values %v; want k-s3cret", up.keys)
	}
	if up.tooMany == 0 {
		t.Fatal("no request was answered 429; the test did not exercise the pause")
	}
	// The fleet pauses as one: after the first 429, at most the requests
	// already under way (8 slots in the fleet) reach the upstream before
	// the pause ends.
	if up.tooMany > 8 {
		t.Errorf("%d requests were answered 429 (%v after the first); want at most the 8 already under way: the whole fleet should pause", up.tooMany, relative(up.firstAt, up.during))
	}
	for _, at := range up.during {
		if d := at.Sub(up.firstAt); d > 500*time.Millisecond {
			t.Errorf("a request reached the upstream %v into its 2s pause; every worker should hold back", d)
		}
	}
}

func relative(base time.Time, ts []time.Time) []time.Duration {
	var out []time.Duration
	for _, t := range ts {
		out = append(out, t.Sub(base).Round(time.Millisecond))
	}
	return out
}

// jobScript is the program of the command test: $1 picks what it does,
// $2 is echoed back, stdin is the payload.
const jobScript = `#!/bin/sh
input=$(cat)
case "$1" in
ok) printf 'in=%s arg=%s greeting=%s type=%s pad=' "$input" "$2" "$GREETING" "$JOBTHROTTLE_TASK_TYPE"; printf '%0200d' 0 ;;
refuse) echo "line one" >&2; echo "the input is not a report" >&2; exit 65 ;;
flaky) if [ -f "$MARK" ]; then printf done; else : > "$MARK"; echo "busy, try later" >&2; exit 3; fi ;;
slow) exec sleep 60 ;;
env) env | sort ;;
esac
`

// A command rule end to end on a real Redis and asynq server: exit 0
// stores stdout (cut) as the result; a no-retry exit code archives at
// once with the stderr tail; another code retries; a timeout kills the
// program; the payload comes on stdin and a field as one whole argument,
// never parsed by a shell; the worker's environment does not leak.
func TestCommandHandlerEndToEnd(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "job.sh")
	if err := os.WriteFile(script, []byte(jobScript), 0o755); err != nil {
		t.Fatal(err)
	}
	mark := filepath.Join(dir, "flaky.mark")
	rules := fmt.Sprintf(`
prefix: %q
rules:
  - name: reports
    tasks: ["report:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 100
    period: 1s
handlers:
  - task: report:render
    result_limit: 300
    command:
      argv: [%q, "{mode}", "{arg}"]
      env: {GREETING: "hello ${TEST_GREETING}", MARK: %q}
      timeout: 3s
`, redistest.Prefix(t), script, mark)
	env := map[string]string{"TEST_GREETING": "world", "PATH": os.Getenv("PATH"), "REDIS_URL": "redis://:hunter2@x:6379"}
	fleet(t, rdb, rules, 1, 4, func(k string) string { return env[k] })

	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	evil := `$(touch ` + filepath.Join(dir, "pwned") + `); echo "quoted" *`
	ids := map[string]string{}
	var all []string
	for _, c := range []struct {
		mode, arg string
		retry     int
	}{{"ok", evil, 3}, {"refuse", "-", 3}, {"flaky", "-", 3}, {"slow", "-", 0}, {"env", "-", 3}} {
		payload, _ := json.Marshal(map[string]any{"tenant": 7, "mode": c.mode, "arg": c.arg})
		info, err := client.Enqueue(asynq.NewTask("report:render", payload), asynq.MaxRetry(c.retry), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ids[c.mode] = info.ID
		all = append(all, info.ID)
	}
	infos := settle(t, insp, all, 30*time.Second)

	ok := infos[ids["ok"]]
	payload, _ := json.Marshal(map[string]any{"tenant": 7, "mode": "ok", "arg": evil})
	wantPrefix := "in=" + string(payload) + " arg=" + evil + " greeting=hello world type=report:render pad=000"
	if ok.State != asynq.TaskStateCompleted || !strings.HasPrefix(string(ok.Result), wantPrefix) || len(ok.Result) != 300 {
		t.Errorf("ok: %v, result (%d bytes) %q; want completed with stdout cut to 300 bytes, starting %q", ok.State, len(ok.Result), ok.Result, wantPrefix)
	}
	if _, err := os.Stat(filepath.Join(dir, "pwned")); err == nil {
		t.Error("a payload value was run by a shell")
	}
	refuse := infos[ids["refuse"]]
	if refuse.State != asynq.TaskStateArchived || refuse.Retried != 0 || !strings.Contains(refuse.LastErr, "exited with 65") ||
		!strings.Contains(refuse.LastErr, `the input is not a report`) {
		t.Errorf("refuse: %v retried %d, last error %q; want archived at once, exit 65 and the stderr tail", refuse.State, refuse.Retried, refuse.LastErr)
	}
	flaky := infos[ids["flaky"]]
	if flaky.State != asynq.TaskStateCompleted || flaky.Retried != 1 || string(flaky.Result) != "done" {
		t.Errorf("flaky: %v retried %d result %q; want completed after one retry", flaky.State, flaky.Retried, flaky.Result)
	}
	slow := infos[ids["slow"]]
	if slow.State != asynq.TaskStateArchived || !strings.Contains(slow.LastErr, "killed after the timeout of 3s") {
		t.Errorf("slow: %v, last error %q; want killed at the timeout (and archived: no retry left)", slow.State, slow.LastErr)
	}
	envOut := string(infos[ids["env"]].Result)
	for _, leak := range []string{"REDIS_URL", "hunter2", "TEST_GREETING"} {
		if strings.Contains(envOut, leak) {
			t.Errorf("the command's environment holds %s:\n%s", leak, envOut)
		}
	}
	if !strings.Contains(envOut, "GREETING=hello world") || !strings.Contains(envOut, "JOBTHROTTLE_TASK_ID="+ids["env"]) {
		t.Errorf("the command's environment lacks GREETING or JOBTHROTTLE_TASK_ID:\n%s", envOut)
	}
}

// A task with no retry left cannot be deferred (asynq would archive it):
// on a 429 it waits in its slot for the upstream's time and sends again.
func TestHTTPHandlerNoRetryLeftWaits(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	up := newUpstream(time.Second)
	api := httptest.NewServer(up)
	t.Cleanup(api.Close)
	rules := fmt.Sprintf(`
prefix: %q
rules:
  - {name: partner, tasks: ["partner:call"], subject: {fixed: partner}, algorithm: gcra, limit: 10, period: 1s}
handlers:
  - {task: "partner:call", http: {method: PUT, url: "%s/v1/items/{item}"}}
`, redistest.Prefix(t), api.URL)
	fleet(t, rdb, rules, 1, 2, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	info, err := client.Enqueue(asynq.NewTask("partner:call", []byte(`{"item": 42}`)), asynq.MaxRetry(0), asynq.Timeout(20*time.Second), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	got := settle(t, asynq.NewInspectorFromRedisClient(rdb), []string{info.ID}, 20*time.Second)[info.ID]
	up.mu.Lock()
	defer up.mu.Unlock()
	if got.State != asynq.TaskStateCompleted || up.tooMany != 1 || fmt.Sprint(up.answered["42"]) != "[200]" || up.bodies["42"] != `{"item": 42}` {
		t.Errorf("task %v (%s), upstream: %d × 429, then %v with body %q; want completed after one 429 and one 200 with the payload",
			got.State, got.LastErr, up.tooMany, up.answered["42"], up.bodies["42"])
	}
}

// An upstream that announces a policy slower than the rule: the handlers
// learn it, and the rule's turns follow it (throttle's Admit reads what
// was learned): a task whose turn is further than the rule's max_wait
// parks until it, nothing sent, no failure counted, and its request
// leaves on that turn.
func TestHTTPHandlerLearnedLimitDefers(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	var mu sync.Mutex
	var calls []time.Time
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls = append(calls, time.Now())
		mu.Unlock()
		w.Header().Set("RateLimit-Policy", `"default";q=2;w=1`)
		fmt.Fprint(w, "ok")
	}))
	t.Cleanup(api.Close)
	rules := fmt.Sprintf(`
prefix: %q
rules:
  - {name: partner, tasks: ["partner:call"], subject: {fixed: partner}, algorithm: gcra, limit: 100, period: 1s, max_wait: 100ms}
handlers:
  - {task: "partner:call", http: {url: "%s/v1/items/{item}"}}
`, redistest.Prefix(t), api.URL)
	// One at a time, so that each request follows an answer.
	fleet(t, rdb, rules, 1, 1, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	var ids []string
	for i := range 4 {
		info, err := client.Enqueue(asynq.NewTask("partner:call", []byte(fmt.Sprintf(`{"item": %d}`, i))), asynq.MaxRetry(2), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.ID)
	}
	infos := settle(t, asynq.NewInspectorFromRedisClient(rdb), ids, 30*time.Second)
	deferred := 0
	for id, info := range infos {
		if info.State != asynq.TaskStateCompleted || info.Retried != 0 || string(info.Result) != "ok" {
			t.Errorf("task %s: %v retried %d result %q (%s)", id, info.State, info.Retried, info.Result, info.LastErr)
		}
		if strings.Contains(info.LastErr, "waiting, not failed") {
			deferred++
		}
	}
	if deferred == 0 {
		t.Error("no task parked for the learned limit")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 4 {
		t.Fatalf("the upstream saw %d requests; want 4: a deferred task sends nothing", len(calls))
	}
	// After the first answer, 2/s at 95%: 526ms apart (the first learned
	// slot is free).
	for i := 2; i < len(calls); i++ {
		if d := calls[i].Sub(calls[i-1]); d < 500*time.Millisecond {
			t.Errorf("requests %d and %d were %v apart; the learned 2/s was not kept", i, i+1, d)
		}
	}
}
