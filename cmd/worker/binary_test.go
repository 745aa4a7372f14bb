package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestMain removes the binary the tests built.
func TestMain(m *testing.M) { os.Exit(cmdtest.Main(m)) }

// closedAddr is a loopback address nothing listens on (port 1, tcpmux,
// is not served on test machines).
const closedAddr = "127.0.0.1:1"

// Usage mistakes exit 2 with one line that says what to fix, never
// "worker: worker:", and never echo a malformed --redis value.
func TestBinaryUsageErrors(t *testing.T) {
	t.Parallel()
	bad := writeRules(t, "rules:\n  - name: stripe\n    tasks: [\"stripe:*\"]\n    subject: {payload_field: account_id}\n    algorithm: gcra\n    limit: 20\n    period: 0s\n")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"unknown flag", []string{"--bogus"}, "flag provided but not defined: -bogus"},
		{"bad flag value", []string{"--concurrency", "x"}, `invalid value "x" for flag -concurrency`},
		{"bad queues", []string{"--queues", "a=0"}, `worker: -queues: "a=0": the priority must be a whole number`},
		{"argument", []string{"extra"}, `worker: unexpected argument "extra"`},
		{"bad rules", []string{"--config", bad}, `worker: ` + bad + `:7: rule "stripe": period: "0s" must be at least 1µs`},
		{"missing rules", []string{"--config", filepath.Join(t.TempDir(), "none.yaml")}, `worker: reading the rules file: open`},
		{"password as URL", []string{"--redis", "hunter2"}, `worker: Redis URL (a Redis URL without scheme://)`},
		{"URL without colon", []string{"--redis", "redis//:hunter2@h:1"}, `worker: Redis URL (a Redis URL without scheme://)`},
		{"URL that does not parse", []string{"--redis", "redis://:hunter2@[::1"}, `worker: Redis URL redis://(does not parse)`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cmdtest.Run(t, nil, c.args...)
			if code != exitUsage || !strings.Contains(stderr, c.want) {
				t.Errorf("worker %s: exit %d, stderr:\n%s\nwant exit 2 and %q", strings.Join(c.args, " "), code, stderr, c.want)
			}
			for _, no := range []string{"worker: worker:", "hunter2"} {
				if strings.Contains(stderr, no) {
					t.Errorf("stderr holds %q:\n%s", no, stderr)
				}
			}
		})
	}
	if code, _, _ := cmdtest.Run(t, nil, "-h"); code != exitOK {
		t.Errorf("-h exits %d, want 0", code)
	}
}

// --check prints the rules and handlers as understood and exits 0, or the
// line-numbered error and exits 2; it connects to nothing and shows no
// secret.
func TestBinaryCheck(t *testing.T) {
	t.Parallel()
	rules := writeRules(t, `prefix: "acme:"
rules:
  - name: partner
    tasks: ["partner:*"]
    subject: {payload_field: account_id}
    algorithm: gcra
    limit: 20
    period: 1s
    burst: 5
    max_wait: 30s
  - name: reports
    tasks: ["report:render"]
    subject: {fixed: all}
    limits:
      - {name: per-minute, algorithm: sliding_window, limit: 100, period: 1m, precision: 1s}
      - {name: daily, algorithm: fixed_window, limit: 5000, period: 24h}
  - name: crm
    tasks: ["crm:*"]
    subject: {fixed: crm-key}
    horizon: 2s
    fair_by: {payload_field: tenant}
    weights: {gold: 3, silver: 2}
    share_limit: {limit: 10, period: 1s}
    algorithm: gcra
    limit: 100
    period: 1s
handlers:
  - task: partner:sync
    http:
      url: "https://api.partner.example/v1/accounts/{account_id}/sync"
      headers: {Authorization: "Bearer ${PARTNER_TOKEN}"}
      timeout: 10s
  - task: report:render
    result_limit: 1024
    command:
      argv: ["/usr/local/bin/render", "--tenant", "{tenant}"]
      no_retry_exit_codes: [2, 65]
`)
	// A Redis URL nobody answers: --check must not need it.
	env := []string{"PARTNER_TOKEN=s3cret-token", "REDIS_URL=redis://" + closedAddr}
	code, stdout, stderr := cmdtest.Run(t, env, "--check", "--config", rules)
	if code != exitOK {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr)
	}
	for _, want := range []string{
		rules + `: OK: 3 rules, 2 handlers; prefix "acme:", fail_open false`,
		`rule "partner" (line 3): tasks partner:*; subject: payload field "account_id"; max_wait: 30s`,
		`  limit partner: gcra, 20 per 1s, burst 5`,
		`rule "reports" (line 11): tasks report:render; subject: fixed "all"; max_wait: the task's deadline`,
		`  limit reports.per-minute: sliding_window, 100 per 1m0s, precision 1s`,
		`  limit reports.daily: fixed_window, 5000 per 24h0m0s`,
		`rule "crm" (line 17): tasks crm:*; subject: fixed "crm-key"; max_wait: the task's deadline`,
		`  limit crm: gcra, 100 per 1s, burst 100`,
		`  line: horizon 2s; fair_by payload field "tenant", weights gold=3 silver=2; share_limit 10 per 1s, burst 10`,
		`handler "partner:sync" (line 28): http POST https://api.partner.example/v1/accounts/{account_id}/sync, timeout 10s, task ID in Idempotency-Key, headers: Authorization from ${PARTNER_TOKEN}, result up to 65536 bytes; limited by rule "partner"`,
		`handler "report:render" (line 33): command ["/usr/local/bin/render" "--tenant" "{tenant}"], timeout 1m0s, SIGKILL 5s after SIGTERM, no retry on exit codes [2 65], result up to 1024 bytes; limited by rule "reports"`,
	} {
		if !strings.Contains(stdout, want+"\n") {
			t.Errorf("stdout lacks the line\n%s\n---\n%s", want, stdout)
		}
	}
	if strings.Contains(stdout+stderr, "s3cret") {
		t.Error("--check shows a header value")
	}

	bad := writeRules(t, "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\nhandlers:\n  - task: x\n    http: {url: \"https://{host}/v1\"}\n")
	code, stdout, stderr = cmdtest.Run(t, nil, "--check", "--config", bad)
	want := `worker: ` + bad + `:5: handlers[1].http.url: "https://{host}/v1": the host must be written out in the file`
	if code != exitUsage || !strings.Contains(stderr, want) || stdout != "" {
		t.Errorf("exit %d, stdout %q, stderr:\n%s\nwant exit 2 and %s", code, stdout, stderr, want)
	}
}

// With --log-format json every log line is JSON, go-redis's own
// included.
func TestBinaryJSONLogs(t *testing.T) {
	t.Parallel()
	code, _, stderr := cmdtest.Run(t, nil, "--log-format", "json", "--redis", "redis://app:hunter2@"+closedAddr+"/0?dial_timeout=100ms")
	if code != exitError {
		t.Errorf("exit %d, want 1 (Redis does not answer)", code)
	}
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	goRedis := 0
	for _, line := range lines[:len(lines)-1] {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Errorf("not a JSON line: %s", line)
			continue
		}
		if rec["component"] == "go-redis" {
			goRedis++
		}
	}
	if goRedis == 0 {
		t.Errorf("no go-redis line came through slog:\n%s", stderr)
	}
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "worker: Redis at redis://app:xxxxx@") {
		t.Errorf("last line %q; want the exit message", last)
	}
	if strings.Contains(stderr, "hunter2") {
		t.Error("the password shows")
	}
}

// /healthz answers while the process is up; /readyz while Redis answers
// and the scripts run. demo:echo takes a numeric tenant.
func TestBinaryHealthAndDemo(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	cmd, log := startBinary(t, []string{"REDIS_URL=" + proc.URL()}, "--metrics-addr", "127.0.0.1:0", "--shutdown-timeout", "2s")
	base := log.waitFor(`url=(http://\S+)/metrics`)[1]
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/healthz"); code != 200 {
		t.Errorf("/healthz: %d %s", code, body)
	}
	if code, body := get("/readyz"); code != 200 {
		t.Errorf("/readyz: %d %s", code, body)
	}

	rdb := proc.Client(t)
	info, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask(TypeEcho, []byte(`{"tenant": 42, "message": "numeric"}`)), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if got := waitCompleted(t, asynq.NewInspectorFromRedisClient(rdb), "default", info.ID); !bytes.Contains(got.Result, []byte("numeric")) {
		t.Errorf("demo:echo result %s", got.Result)
	}

	proc.Stop()
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "Redis does not answer") {
		t.Errorf("/readyz with Redis stopped: %d %s; want 503 naming Redis", code, body)
	}
	if code, _ := get("/healthz"); code != 200 {
		t.Errorf("/healthz with Redis stopped: %d; the process is still up", code)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	go log.rest()
}

// binaryLog is the stderr of a worker started by startBinary, line by line.
type binaryLog struct {
	t     *testing.T
	lines chan string
	seen  strings.Builder // the lines read so far
}

// startBinary starts the worker with env and args, kills it when the test
// ends if it is still running, and returns its log.
func startBinary(t *testing.T, env []string, args ...string) (*exec.Cmd, *binaryLog) {
	t.Helper()
	cmd := cmdtest.Command(t, env, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	l := &binaryLog{t: t, lines: make(chan string, 1000)}
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			l.lines <- sc.Text()
		}
		close(l.lines)
	}()
	return cmd, l
}

// waitFor reads the log until a line matches re, within 15s, and returns
// the match and its groups.
func (l *binaryLog) waitFor(re string) []string {
	l.t.Helper()
	rx := regexp.MustCompile(re)
	timeout := time.After(15 * time.Second)
	for {
		select {
		case line, ok := <-l.lines:
			if !ok {
				l.t.Fatalf("the worker ended before logging %s:\n%s", re, l.seen.String())
			}
			l.seen.WriteString(line + "\n")
			if m := rx.FindStringSubmatch(line); m != nil {
				return m
			}
		case <-timeout:
			l.t.Fatalf("no line matched %s within 15s:\n%s", re, l.seen.String())
		}
	}
}

// rest reads the log to its end (the process has exited) and returns all
// of it.
func (l *binaryLog) rest() string {
	for line := range l.lines {
		l.seen.WriteString(line + "\n")
	}
	return l.seen.String()
}
