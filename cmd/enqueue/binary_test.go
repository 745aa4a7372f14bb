package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
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
		{[]string{"schedule", "--config", noSubject}, noSubject + `:3: schedule "reports": payload: payload has no field "tenant"; a paced task needs the subject the workers' rule reads`},
		{[]string{"schedule", "--config", noSubjectFile}, noSubjectFile + `:3: schedule "reports": payloads: payload 3 of tenants.jsonl: payload has no field "tenant"`},
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
	// The subject is there but longer than throttle accepts: the firing
	// fails when it books the first slot.
	long := strings.Repeat("x", 1100)
	sched := writeFile(t, dir, "s.yaml", fmt.Sprintf(`schedules:
  - name: tick
    cron: "@every 1s"
    type: t
    count: 1
    payload: {tenant: %q}
    pace: {rule: r, rate: 10/s, subject: {payload_field: tenant}}
`, long))
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
