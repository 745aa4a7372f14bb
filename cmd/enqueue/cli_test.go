package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const rulesFile = `rules:
  - name: api
    tasks: ["demo:*"]
    subject: {fixed: acme}
    algorithm: gcra
    limit: 20
    period: 1s
    burst: 1
`

func writeFile(t *testing.T, dir, name, data string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func runCmd(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb, func(k string) string { return env[k] })
	return code, out.String(), errb.String()
}

// Flag mistakes are usage errors (exit 2) with a message that says what to
// do, found before any connection is made.
func TestBatchFlagErrors(t *testing.T) {
	dir := t.TempDir()
	rules := writeFile(t, dir, "rules.yaml", rulesFile)
	bad := writeFile(t, dir, "bad.jsonl", "{}\nnope\n")
	cases := []struct {
		args []string
		want string
	}{
		{nil, "usage:"},
		{[]string{"frob"}, `unknown command "frob"`},
		{[]string{"batch", "--count", "1"}, "--type is required"},
		{[]string{"batch", "--type", "t"}, "--count is required"},
		{[]string{"batch", "--type", "t", "--count", "-1"}, "must be at least 1"},
		{[]string{"batch", "--type", "t", "--count", "1", "--payload", "{"}, "--payload is not valid JSON"},
		{[]string{"batch", "--type", "t", "--payload", "{}", "--payloads", bad}, "cannot be combined"},
		{[]string{"batch", "--type", "t", "--payloads", bad}, bad + ":2: not a JSON value"},
		{[]string{"batch", "--type", "t", "--count", "1", "--rate", "5/s"}, "--rate paces the batch: add --pace"},
		{[]string{"batch", "--type", "t", "--count", "1", "--wakeup-shards", "5"}, "--wakeup-shards paces the batch: add --pace"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rate", "5/s", "--rule", "r", "--subject", "s", "--wakeup-shards", "65"}, "is too large: at most 64"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace"}, "--pace needs the workers' rule"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule-config", rules, "--rate", "5/s"}, "cannot be combined"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule-config", rules, "--burst", "3"}, "--burst comes from --rule-config"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rate", "5/s", "--subject", "s"}, "--rate needs --rule"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule", "r", "--rate", "5/s"}, "exactly one of --subject and --subject-field"},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule", "r", "--rate", "fast", "--subject", "s"}, `--rate: rate "fast"`},
		{[]string{"batch", "--type", "t", "--count", "1", "--pace", "--rule-config", filepath.Join(dir, "none.yaml")}, "reading rules file"},
		{[]string{"batch", "--type", "t", "--count", "1", "extra"}, `unexpected argument "extra"`},
		{[]string{"schedule"}, "--config is required"},
		{[]string{"schedule", "--config", filepath.Join(dir, "none.yaml")}, "reading schedules file"},
	}
	for _, c := range cases {
		code, _, stderr := runCmd(t, nil, c.args...)
		if code != exitUsage || !strings.Contains(stderr, c.want) {
			t.Errorf("enqueue %s: exit %d, stderr %q; want exit 2 and %q", strings.Join(c.args, " "), code, stderr, c.want)
		}
	}
}

// A password in the Redis URL never reaches the output.
func TestRedisPasswordNeverShown(t *testing.T) {
	for _, url := range []string{
		"redis://user:hunter2secret@127.0.0.1:1/0",
		"redis://user:hunter2secret@127.0.0.1:x/0",
		"redis://:hunter2secret@[::1/0",
		"rediss://user:hunter2secret@127.0.0.1:1/99x",
	} {
		for _, env := range []bool{false, true} {
			args := []string{"batch", "--type", "t", "--count", "1"}
			e := map[string]string{}
			if env {
				e["REDIS_URL"] = url
			} else {
				args = append(args, "--redis", url)
			}
			code, stdout, stderr := runCmd(t, e, args...)
			if code == exitOK || strings.Contains(stdout+stderr, "hunter2") {
				t.Errorf("%s (env %v): exit %d, output %q", url, env, code, stdout+stderr)
			}
		}
	}
}

// enqueue batch --pace on a rules file, against a Redis: the tasks are
// scheduled one interval apart, each with a receipt the workers' limiter
// redeems.
func TestBatchPacedEndToEnd(t *testing.T) {
	m := miniredis.RunT(t)
	dir := t.TempDir()
	rulesPath := writeFile(t, dir, "rules.yaml", rulesFile)
	payloads := writeFile(t, dir, "p.jsonl", "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n{\"n\":4}\n")
	url := "redis://" + m.Addr()
	code, stdout, stderr := runCmd(t, map[string]string{"REDIS_URL": url},
		"batch", "--type", "demo:x", "--payloads", payloads, "--queue", "q", "--pace", "--rule-config", rulesPath)
	if code != exitOK || !strings.Contains(stdout, "enqueued 4 demo:x tasks") || !strings.Contains(stdout, "paced") {
		t.Fatalf("exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, `msg="enqueue: progress" enqueued=4 of=4`) {
		t.Errorf("no progress lines when not on a terminal:\n%s", stderr)
	}

	rdb, err := redisurl.Open(url)
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	insp := asynq.NewInspectorFromRedisClient(rdb)
	pending, _ := insp.ListPendingTasks("q")
	scheduled, err := insp.ListScheduledTasks("q")
	if err != nil {
		t.Fatal(err)
	}
	if got := len(pending) + len(scheduled); got != 4 {
		t.Fatalf("%d tasks in queue q, want 4", got)
	}
	cfg, err := rules.Load(rulesPath)
	if err != nil {
		t.Fatal(err)
	}
	lim, err := cfg.Limiter(rdb, "api", throttle.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, ti := range append(pending, scheduled...) {
		a, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "acme", N: 1, Caller: throttle.Caller{Receipt: ti.Headers[admission.ReceiptHeader]}, Wait: -1, Tolerance: time.Hour})
		d, ok := a.Delay, a.Status == throttle.Redeemed
		// The first slot is enqueue.Reach after the batch began, the last
		// three intervals later (20/s).
		if err != nil || !ok || d > enqueue.Reach+200*time.Millisecond {
			t.Errorf("task %s: Redeem = %v, %v, %v; want ok within %v", ti.Payload, d, ok, err, enqueue.Reach+200*time.Millisecond)
		}
	}
}

// enqueue schedule runs its schedules for --run-for and stops.
func TestScheduleRunsFor(t *testing.T) {
	m := miniredis.RunT(t)
	dir := t.TempDir()
	cfg := writeFile(t, dir, "s.yaml", "schedules:\n  - {name: tick, cron: \"@every 1s\", type: t, count: 2, queue: q}\n")
	start := time.Now()
	code, _, stderr := runCmd(t, nil, "schedule", "--config", cfg, "--run-for", "1500ms", "--redis", "redis://"+m.Addr())
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if el := time.Since(start); el < 1500*time.Millisecond || el > 5*time.Second {
		t.Errorf("ran for %v, want about 1.5s", el)
	}
	if !strings.Contains(stderr, `msg="enqueue: batch enqueued" schedule=tick firing=1 enqueued=2`) {
		t.Errorf("no firing logged:\n%s", stderr)
	}
}
