package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestMain removes the binary the tests built.
func TestMain(m *testing.M) { os.Exit(cmdtest.Main(m)) }

// Values asynq would take and misuse are refused before any connection,
// with exit 2 and a message that says what to write.
func TestBinaryRejectsBadValues(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	rules := writeFile(t, dir, "rules.yaml", rulesFile+"  - name: tenants\n    tasks: [\"report:*\"]\n    subject: {payload_field: tenant}\n    algorithm: gcra\n    limit: 5\n    period: 1s\n")
	every0 := writeFile(t, dir, "every0.yaml", "schedules:\n  - name: tick\n    cron: \"@every 0s\"\n    type: t\n    count: 1\n")
	noSubject := writeFile(t, dir, "nosubject.yaml", "rules: rules.yaml\nschedules:\n  - name: reports\n    cron: \"@every 1m\"\n    type: report:build\n    count: 3\n    payload: {kind: weekly}\n    pace: {}\n")
	writeFile(t, dir, "tenants.jsonl", "{\"tenant\": \"a\"}\n{\"tenant\": 7}\n{\"other\": 1}\n")
	noSubjectFile := writeFile(t, dir, "nosubject2.yaml", "rules: rules.yaml\nschedules:\n  - name: reports\n    cron: \"@every 1m\"\n    type: report:build\n    payloads: tenants.jsonl\n    pace: {}\n")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"batch", "--type", "t", "--count", "1", "--max-retry", "-5"}, "enqueue batch: --max-retry -5 must be 0 or more"},
		{[]string{"batch", "--type", "t", "--count", "1", "--timeout", "-1s"}, "enqueue batch: --timeout -1s must be positive"},
		{[]string{"batch", "--type", "t", "--count", "1", "--retention", "0s"}, "enqueue batch: --retention 0s must be positive"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule-config", rules, "--keep", "-1s"}, "enqueue batch: --keep -1s must be positive"},
		{[]string{"batch", "--type", "t", "--count", "1", "--bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"schedule", "--config", every0}, every0 + `:3: schedule "tick": cron: "@every 0s": the interval must be at least 1s`},
		{[]string{"schedule", "--config", noSubject}, noSubject + `:3: schedule "reports": payload: subject: payload has no field "tenant"; a paced task needs the subject (and cost) the workers' rule reads`},
		{[]string{"schedule", "--config", noSubjectFile}, noSubjectFile + `:3: schedule "reports": payloads: ` + filepath.Join(dir, "tenants.jsonl") + `:3: subject: payload has no field "tenant"`},
	}
	for _, c := range cases {
		code, _, stderr := cmdtest.Run(t, []string{"REDIS_URL=redis://127.0.0.1:1"}, c.args...)
		if code != exitUsage || !strings.Contains(stderr, c.want) {
			t.Errorf("enqueue %s: exit %d, stderr:\n%s\nwant exit 2 and %q", strings.Join(c.args, " "), code, stderr, c.want)
		}
	}
}

// --retention reaches asynq: the completed task would be kept that long.
func TestBinaryRetention(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	code, stdout, stderr := cmdtest.Run(t, []string{"REDIS_URL=" + proc.URL()}, "batch", "--type", "t", "--count", "1", "--queue", "kept", "--retention", "2h")
	if code != exitOK || !strings.Contains(stdout, "enqueued 1 t tasks") {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	tasks, err := asynq.NewInspectorFromRedisClient(proc.Client(t)).ListPendingTasks("kept")
	if err != nil || len(tasks) != 1 {
		t.Fatalf("pending tasks %v, %v", tasks, err)
	}
	if tasks[0].Retention != 2*time.Hour {
		t.Errorf("retention %v, want 2h", tasks[0].Retention)
	}
}

// A firing that fails is counted in jobthrottle_schedule_firings_total and
// makes a --run-for run exit 1.
func TestBinaryFailedFiring(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	dir := t.TempDir()
	// The rule's key holds a list, not a limiter's state: every firing
	// fails when it reads the ledger, as it would with Redis failing.
	if err := proc.Client(t).LPush(t.Context(), throttle.DefaultPrefix+"{acme}:r", "not a limiter").Err(); err != nil {
		t.Fatal(err)
	}
	sched := writeFile(t, dir, "s.yaml", `schedules:
  - name: tick
    cron: "@every 1s"
    type: t
    count: 1
    payload: {tenant: acme}
    pace: {rule: r, rate: 10/s, subject: {payload_field: tenant}}
`)
	cmd := cmdtest.Command(t, []string{"REDIS_URL=" + proc.URL()}, "schedule", "--config", sched, "--run-for", "2500ms", "--metrics-addr", "127.0.0.1:0")
	pipe, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	sc := bufio.NewScanner(pipe)
	metricsURL := ""
	rx := regexp.MustCompile(`url=(http://\S+/metrics)`)
	for sc.Scan() {
		line := sc.Text()
		log.WriteString(line + "\n")
		if m := rx.FindStringSubmatch(line); m != nil {
			metricsURL = m[1]
		}
		if strings.Contains(line, "batch failed") {
			break
		}
	}
	if metricsURL == "" {
		t.Fatalf("no metrics URL or failed batch in the log:\n%s", log.String())
	}
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `jobthrottle_schedule_firings_total{outcome="failed",schedule="tick"}`) {
		t.Errorf("no failed firing in the metrics:\n%s", body)
	}
	go func() {
		for sc.Scan() {
			log.WriteString(sc.Text() + "\n")
		}
	}()
	err = cmd.Wait()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != exitError {
		t.Errorf("exit %v; want 1 after a failed firing", err)
	}
}

// Usage errors exit 2 and runtime errors 1, as in cmd/worker: a mistake
// the user fixes in the command line or a file (a malformed --redis
// included) is 2, whatever Redis does; Redis refusing or not answering
// is 1. Every message says what is wrong in the user's terms.
func TestBinaryExitCodes(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	guarded := redistest.Server(t, redistest.Args("--requirepass", "the-right-one"))
	dir := t.TempDir()
	rules := writeFile(t, dir, "rules.yaml", rulesFile)
	huge := writeFile(t, dir, "huge.yaml", strings.Replace(rulesFile, "limit: 20", "limit: 99999999999999999999999", 1))
	up, down := []string{"REDIS_URL=" + proc.URL()}, []string{"REDIS_URL=redis://127.0.0.1:1/0"}
	batch := func(args ...string) []string { return append([]string{"batch", "--type", "demo:x"}, args...) }
	inline := []string{"--pace", "--rule", "r", "--subject", "s"}
	cases := []struct {
		name string
		env  []string
		args []string
		code int
		want string
	}{
		{"no command", up, nil, exitUsage, "usage:"},
		{"unknown flag", up, batch("--count", "1", "--bogus"), exitUsage, "flag provided but not defined: -bogus"},
		{"count 0", up, batch("--count", "0"), exitUsage, `invalid value "0" for flag -count: must be at least 1`},
		{"count far too large", up, batch(append([]string{"--count", "100000000000", "--rate", "1/s"}, inline...)...), exitUsage, `invalid value "100000000000" for flag -count: is too large: at most 10000000`},
		{"count beyond int64", up, batch("--count", "99999999999999999999999"), exitUsage, "is too large: at most 10000000"},
		{"negative burst", up, batch(append([]string{"--count", "1", "--rate", "5/s", "--burst", "-1"}, inline...)...), exitUsage, `invalid value "-1" for flag -burst: must be at least 1`},
		{"rate count too large", up, batch(append([]string{"--count", "1", "--rate", "99999999999999999999999/s"}, inline...)...), exitUsage, `the count "99999999999999999999999" is too large: at most 1099511627776`},
		{"limit too large in the rules file", up, batch("--count", "1", "--pace", "--rule-config", huge), exitUsage, `limit: "99999999999999999999999" is too large: at most 1099511627776`},
		{"max-ahead without pace", up, batch("--count", "1", "--max-ahead", "48h"), exitUsage, "--max-ahead paces the batch: add --pace"},
		{"malformed --redis", up, batch("--count", "1", "--redis", "redis://127.0.0.1:x/0"), exitUsage, "Redis URL redis://(does not parse)"},
		{"--redis without scheme", up, batch("--count", "1", "--redis", "hunter2secret"), exitUsage, "Redis URL (a Redis URL without scheme://)"},
		{"malformed REDIS_URL for schedule", []string{"REDIS_URL=redis://127.0.0.1:x/0"}, []string{"schedule", "--config", writeFile(t, dir, "ok.yaml", "schedules:\n  - {name: tick, cron: \"@every 1s\", type: t, count: 1}\n")}, exitUsage, "Redis URL"},
		{"rules mistake with Redis down", down, batch("--count", "1", "--pace", "--rule-config", huge), exitUsage, "too large"},
		{"Redis down", down, batch("--count", "1"), exitError, "Redis at redis://127.0.0.1:1/0 does not answer"},
		{"wrong password", nil, batch("--count", "1", "--redis", "redis://:hunter2secret@"+guarded.Addr()+"/0"), exitError, "Redis at redis://:xxxxx@" + guarded.Addr() + "/0: authentication failed (WRONGPASS"},
		{"beyond --max-ahead", up, batch(append([]string{"--count", "100000", "--rate", "1/s"}, inline...)...), exitUsage,
			"pacing 100000 tasks at 1/s (rule r): the last is booked about 27h47m ahead, more than --max-ahead 24h0m0s; split the batch, or raise --max-ahead"},
		{"paced under the rules file", up, batch("--count", "3", "--pace", "--rule-config", rules, "--queue", "ok"), exitOK, "pacing 3 tasks at 20/s (rule api): the last is booked about 100ms ahead"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := cmdtest.Run(t, c.env, c.args...)
			if code != c.code || !strings.Contains(stderr, c.want) || strings.Contains(stdout+stderr, "hunter2") {
				t.Errorf("enqueue %s: exit %d, stderr:\n%s\nwant exit %d and %q (and no password)", strings.Join(c.args, " "), code, stderr, c.code, c.want)
			}
			if strings.Contains(stderr, "PerSecond") || strings.Contains(stderr, "friends") {
				t.Errorf("a library name in a CLI message:\n%s", stderr)
			}
		})
	}
	queues, err := asynq.NewInspectorFromRedisClient(proc.Client(t)).Queues()
	if err != nil || strings.Join(queues, ",") != "ok" {
		t.Errorf("queues %v, %v; want only the successful batch's (ok): a refused batch enqueues nothing", queues, err)
	}
}

// A batch whose payloads file has a bad line anywhere enqueues nothing
// and books nothing: every line is checked (JSON, and the subject and cost
// the workers' rule reads) before the first task. The error names the line.
func TestBinaryBadLineEnqueuesNothing(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	dir := t.TempDir()
	rules := writeFile(t, dir, "rules.yaml", `rules:
  - name: accounts
    tasks: ["sync:*"]
    subject: {payload_field: account}
    cost: {payload_field: n}
    algorithm: gcra
    limit: 20
    period: 1s
    burst: 5
`)
	lines := func(bad int, text string) string {
		var b strings.Builder
		for i := 1; i <= 600; i++ {
			if i == bad {
				b.WriteString(text + "\n")
				continue
			}
			fmt.Fprintf(&b, "{\"account\": \"a%d\", \"n\": 1}\n", i%7)
		}
		return b.String()
	}
	cases := []struct {
		name, file, want string
	}{
		{"not JSON on line 2", lines(2, "{nope"), ":2: not a JSON value"},
		{"no subject on line 2", lines(2, `{"n": 1}`), `:2: subject: payload has no field "account"`},
		{"no subject on line 500", lines(500, `{"n": 1}`), `:500: subject: payload has no field "account"`},
		{"a bad cost on line 500", lines(500, `{"account": "a", "n": "two"}`), `:500: cost: payload cost field "n" is a string`},
		{"a cost above the burst on line 500", lines(500, `{"account": "a", "n": 6}`), `:500: throttle: request exceeds the limit's capacity: rule "accounts": 6 permits requested, but it admits at most 5 at once`},
	}
	for i, c := range cases {
		path := writeFile(t, dir, fmt.Sprintf("p%d.jsonl", i), c.file)
		code, _, stderr := cmdtest.Run(t, []string{"REDIS_URL=" + proc.URL()},
			"batch", "--type", "sync:account", "--payloads", path, "--queue", "q", "--pace", "--rule-config", rules)
		if code != exitUsage || !strings.HasPrefix(stderr, "enqueue batch: ") || !strings.Contains(stderr, path+c.want) {
			t.Errorf("%s: exit %d, stderr:\n%s\nwant exit 2 and %q", c.name, code, stderr, path+c.want)
		}
	}
	if n, err := proc.Client(t).DBSize(t.Context()).Result(); err != nil || n != 0 {
		t.Errorf("Redis holds %d keys (%v) after refused batches; want none: nothing enqueued, nothing booked", n, err)
	}
	if queues, err := asynq.NewInspectorFromRedisClient(proc.Client(t)).Queues(); err != nil || len(queues) != 0 {
		t.Errorf("queues %v, %v; want none", queues, err)
	}
}
