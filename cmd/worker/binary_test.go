package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestMain removes the binary the tests built.
func TestMain(m *testing.M) { os.Exit(cmdtest.Main(m)) }

// closedAddr is a loopback address nothing listens on (port 1, tcpmux,
// is not served on test machines).
const closedAddr = "127.0.0.1:1"

// Each mistake exits with one line that says what to fix, never
// "worker: worker:", and never echoes a malformed --redis value: 2 for a
// mistake in the flags, the rules file or the environment it needs, 1 for
// a failure at run time.
func TestBinaryExitCodes(t *testing.T) {
	t.Parallel()
	bad := writeRules(t, "rules:\n  - name: stripe\n    tasks: [\"stripe:*\"]\n    subject: {payload_field: account_id}\n    algorithm: gcra\n    limit: 20\n    period: 0s\n")
	good := writeRules(t, "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n")
	unset := writeRules(t, "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\nhandlers:\n  - task: x\n    http: {url: \"https://api.example/v1\", headers: {Authorization: \"Bearer ${UNSET_TOKEN}\"}}\n")
	// Held for the test: a port in use.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = taken.Close() })
	locked := redistest.Server(t, redistest.Args("--requirepass", "right-password"))
	noRedis := "REDIS_URL=redis://" + closedAddr + "/0?dial_timeout=100ms"
	cases := []struct {
		name string
		env  []string
		args []string
		code int
		want string
	}{
		{"unknown flag", nil, []string{"--bogus"}, exitUsage, "flag provided but not defined: -bogus"},
		{"bad flag value", nil, []string{"--concurrency", "x"}, exitUsage, `invalid value "x" for flag -concurrency`},
		{"bad queues", nil, []string{"--queues", "a=0"}, exitUsage, `worker: -queues: "a=0": the priority must be a whole number`},
		{"argument", nil, []string{"extra"}, exitUsage, `worker: unexpected argument "extra"`},
		{"bad metrics address", nil, []string{"--metrics-addr", "9090"}, exitUsage, `worker: -metrics-addr "9090": want host:port or :port`},
		{"bad embedded address", nil, []string{"--embedded-redis-addr", "localhost"}, exitUsage, `worker: -embedded-redis-addr "localhost": want host:port or :port`},
		{"demo rate without the demo", nil, []string{"--config", good, "--demo-api-rate", "9"}, exitUsage, `worker: -demo-api-rate applies to the demo task types, which a worker with a rules file serves only with -demo`},
		{"bad rules", nil, []string{"--config", bad}, exitUsage, `worker: ` + bad + `:7: rule "stripe": period: "0s" must be at least 1µs`},
		{"missing rules", nil, []string{"--config", filepath.Join(t.TempDir(), "none.yaml")}, exitUsage, `worker: reading the rules file: open`},
		{"unset variable", []string{noRedis}, []string{"--config", unset}, exitUsage, `worker: ` + unset + `:4: handler for "x": header Authorization: environment variable UNSET_TOKEN is not set`},
		{"password as URL", nil, []string{"--redis", "hunter2"}, exitUsage, `worker: Redis URL (a Redis URL without scheme://)`},
		{"URL without colon", nil, []string{"--redis", "redis//:hunter2@h:1"}, exitUsage, `worker: Redis URL (a Redis URL without scheme://)`},
		{"URL that does not parse", nil, []string{"--redis", "redis://:hunter2@[::1"}, exitUsage, `worker: Redis URL redis://(does not parse)`},
		{"--check, URL that does not parse", []string{"REDIS_URL=redis://:hunter2@[::1"}, []string{"--check"}, exitUsage, `worker: Redis URL redis://(does not parse)`},

		{"Redis does not answer", []string{noRedis}, []string{"--config", good}, exitError, `worker: Redis at redis://` + closedAddr + `/0?dial_timeout=100ms does not answer: `},
		{"wrong password", []string{"REDIS_URL=redis://:hunter2@" + locked.Addr() + "/0"}, []string{"--config", good}, exitError, `worker: Redis at redis://:xxxxx@` + locked.Addr() + `/0 answered with an error: WRONGPASS`},
		{"metrics port in use", nil, []string{"--config", good, "--metrics-addr", taken.Addr().String()}, exitError, `worker: -metrics-addr: listen tcp ` + taken.Addr().String() + `: bind: address already in use`},
		{"embedded Redis port in use", nil, []string{"--config", good, "--embedded-redis-addr", taken.Addr().String()}, exitError, `address already in use`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cmdtest.Run(t, c.env, c.args...)
			if code != c.code || !strings.Contains(stderr, c.want) {
				t.Errorf("worker %s: exit %d, stderr:\n%s\nwant exit %d and %q", strings.Join(c.args, " "), code, stderr, c.code, c.want)
			}
			for _, no := range []string{"worker: worker:", "hunter2", "panic"} {
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

// --check refuses what start refuses short of Redis, with the same line
// and exit 2; start refuses it before it connects (so the message is not
// about the Redis that does not answer).
func TestBinaryCheckAsStart(t *testing.T) {
	t.Parallel()
	const rule = "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n"
	cases := []struct {
		name, file, want string
	}{
		{"unset variable in a header", rule + "handlers:\n  - task: x\n    http: {url: \"https://api.example/v1\", headers: {Authorization: \"Bearer ${UNSET_TOKEN}\"}}\n",
			`:4: handler for "x": header Authorization: environment variable UNSET_TOKEN is not set`},
		{"unset variable in a command's env", rule + "handlers:\n  - task: x\n    command: {argv: [\"/bin/echo\"], env: {KEY: \"${UNSET_KEY}\"}}\n",
			`:4: handler for "x": env KEY: environment variable UNSET_KEY is not set`},
		{"command not on $PATH", rule + "handlers:\n  - task: x\n    command: {argv: [\"no-such-program-jobthrottle\"]}\n",
			`:4: handler for "x": command: exec: "no-such-program-jobthrottle": executable file not found in $PATH`},
		{"fair_by on a concurrency limit", "rules:\n  - {name: c, tasks: [a], subject: {fixed: s}, fair_by: {payload_field: tenant}, algorithm: concurrency, limit: 2, lease: 10s}\n",
			`rules.yaml:2: rule "c": fair_by: cannot share a concurrency limit`},
	}
	env := []string{"REDIS_URL=redis://" + closedAddr + "/0?dial_timeout=100ms"}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			path := writeRules(t, c.file)
			checkCode, checkOut, checkErr := cmdtest.Run(t, env, "--check", "--config", path)
			startCode, _, startErr := cmdtest.Run(t, env, "--config", path)
			if checkCode != exitUsage || checkOut != "" || !strings.Contains(checkErr, c.want) {
				t.Errorf("--check: exit %d, stdout %q, stderr:\n%s\nwant exit 2 and %q", checkCode, checkOut, checkErr, c.want)
			}
			if startCode != exitUsage || startErr != checkErr {
				t.Errorf("start: exit %d, stderr:\n%s\nwant exit 2 and what --check said:\n%s", startCode, startErr, checkErr)
			}
		})
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
      - {name: daily, algorithm: fixed_window, limit: 5000, period: 24h, cost: {payload_field: pages}}
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
    within: partner
handlers:
  - task: partner:sync
    http:
      url: "https://api.partner.example/v1/accounts/{account_id}/sync"
      headers: {Authorization: "Bearer ${PARTNER_TOKEN}"}
      timeout: 10s
  - task: report:render
    result_limit: 1024
    command:
      argv: ["/bin/echo", "--tenant", "{tenant}"]
      no_retry_exit_codes: [2, 65]
`)
	// A Redis URL nobody answers: --check must not need it.
	env := []string{"PARTNER_TOKEN=s3cret-token", "REDIS_URL=redis://" + closedAddr}
	code, stdout, stderr := cmdtest.Run(t, env, "--check", "--config", rules)
	if code != exitOK || stderr != "" {
		t.Fatalf("exit %d, stderr:\n%s\nwant exit 0 and nothing on stderr (no log, no dial)", code, stderr)
	}
	for _, want := range []string{
		rules + `: OK: 3 rules, 2 handlers; prefix "acme:", fail_open false`,
		`rule "partner" (line 3): tasks partner:*; subject: payload field "account_id"; max_wait: 30s`,
		`  limit partner: gcra, 20 per 1s, burst 5`,
		`rule "reports" (line 11): tasks report:render; subject: fixed "all"; max_wait: 1s (the default)`,
		`  limit reports.per-minute: sliding_window, 100 per 1m0s, precision 1s; cost 1`,
		`  limit reports.daily: fixed_window, 5000 per 24h0m0s; cost payload field "pages"`,
		`rule "crm" (line 17): tasks crm:*; subject: fixed "crm-key"; max_wait: 1s (the default)`,
		`  limit crm: gcra, 100 per 1s, burst 100`,
		`  line: horizon 2s; fair_by payload field "tenant", weights gold=3 silver=2; share_limit 10 per 1s, burst 10`,
		`  within rule "partner": its tasks also take a turn of it, and park once, on the slower of the two`,
		`handler "partner:sync" (line 29): http POST https://api.partner.example/v1/accounts/{account_id}/sync, timeout 10s, task ID in Idempotency-Key, headers: Authorization from ${PARTNER_TOKEN}, result up to 65536 bytes; limited by rule "partner"`,
		`handler "report:render" (line 34): command ["/bin/echo" "--tenant" "{tenant}"], timeout 1m0s, SIGKILL 5s after SIGTERM, no retry on exit codes [2 65], result up to 1024 bytes; limited by rule "reports"`,
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

	// Redis takes commands and answers none for 2s: /readyz gives up
	// after readyTimeout, not after go-redis's read timeout (3s).
	if err := rdb.Do(context.Background(), "CLIENT", "PAUSE", "2000", "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "not ready: Redis does not answer within 500ms") {
		t.Errorf("/readyz with Redis paused: %d %s; want 503 within readyTimeout", code, body)
	}

	proc.Kill() // SHUTDOWN would wait for the pause
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

// A second SIGTERM stops the worker at once, with one line that says so
// and exit 1, while a task still runs and the shutdown timeout is far off.
func TestBinarySecondSignal(t *testing.T) {
	t.Parallel()
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select { // a call that does not end while the test runs
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(upstream.Close)
	t.Cleanup(func() { close(release) }) // runs first
	rules := writeRules(t, `rules:
  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
handlers:
  - task: slow:call
    http: {url: "`+upstream.URL+`/hang", timeout: 5m}
`)
	cmd, log := startBinary(t, nil, "--config", rules, "--shutdown-timeout", "5m")
	url := log.waitFor(`url=(redis://127\.0\.0\.1:\d+/0)`)[1]
	log.waitFor(`msg="worker: processing"`)
	opts, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask("slow:call", nil)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-arrived:
	case <-time.After(15 * time.Second):
		t.Fatalf("the task's call never came:\n%s", log.seen.String())
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	log.waitFor(`msg="worker: shutting down: .*a second SIGTERM or SIGINT stops at once"`)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	log.waitFor(`level=ERROR msg="worker: second signal: stopping at once, without waiting for running tasks; asynq runs them again when their lease expires" signal=terminated`)
	all := log.rest()
	var exit *exec.ExitError
	if err := cmd.Wait(); !errors.As(err, &exit) || exit.ExitCode() != exitError {
		t.Errorf("exit: %v; want exit status 1:\n%s", err, all)
	}
	for _, no := range []string{"worker: stopped", "panic", "\nworker: "} {
		if strings.Contains(all, no) {
			t.Errorf("stderr holds %q:\n%s", no, all)
		}
	}
}
