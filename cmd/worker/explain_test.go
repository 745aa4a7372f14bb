package main

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/cmdtest"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// worker explain, run as an operator runs it on a real Redis: a task with
// a turn booked under its ID (as a parked one has), in text and in JSON,
// and a task no rule applies to.
func TestBinaryExplain(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	path := writeRules(t, fmt.Sprintf("prefix: %q\nrules:\n  - {name: partner, tasks: [\"partner:*\"], subject: {payload_field: acct}, algorithm: gcra, limit: 1, period: 1m}\n", redistest.Prefix(t)))
	client := asynq.NewClientFromRedisClient(rdb)
	enqueue := func(typ, payload string) string {
		info, err := client.Enqueue(asynq.NewTask(typ, []byte(payload)), asynq.Queue("explain"))
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}
	booked, other := enqueue("partner:sync", `{"acct": "a 1"}`), enqueue("other:x", `{}`)
	slot := bookTurn(t, rdb, path, "partner", "a 1", booked)
	env := []string{"REDIS_URL=" + proc.URL()}

	code, stdout, stderr := cmdtest.Run(t, env, "explain", "--config", path, booked)
	for _, want := range []string{
		"task " + booked + ` (partner:sync) is pending in queue "explain": it runs when a worker is free` + "\n",
		`  rule "partner" (limits partner), subject "a 1"` + "\n",
		"  turn booked for " + slot.UTC().Format("2006-01-02T15:04:05.000Z") + " (in ",
		"  asynq: pending, retried 0 of 25",
	} {
		if code != exitOK || !strings.Contains(stdout, want) {
			t.Errorf("explain: exit %d, stderr %q, stdout:\n%s\nwant exit 0 and %q", code, stderr, stdout, want)
		}
	}

	// Flags after the ID too; JSON decodes to the documented struct.
	code, stdout, _ = cmdtest.Run(t, env, "explain", booked, "--json", "--config", path)
	e := decodeExplanation(t, code, stdout)
	if e.TaskID != booked || e.Queue != "explain" || e.Status != worker.StatusPending || !e.RulesKnown || e.Rule == nil ||
		e.Rule.Name != "partner" || e.Rule.Subject != "a 1" || e.Rule.Turn == nil || !e.Rule.Turn.Equal(slot) || e.Now.IsZero() {
		t.Errorf("--json: %+v, rule %+v; want pending, rule partner for \"a 1\", turn %v", e, e.Rule, slot)
	}

	code, stdout, _ = cmdtest.Run(t, env, "explain", "--queue", "explain", "--config", path, other)
	if code != exitOK || !strings.Contains(stdout, "pending in queue \"explain\": it runs when a worker is free\n  no rule applies to type \"other:x\"\n") {
		t.Errorf("no rule: exit %d:\n%s", code, stdout)
	}
	code, stdout, _ = cmdtest.Run(t, env, "explain", other)
	if code != exitOK || !strings.Contains(stdout, "  rule: unknown without the rules file (--config)\n") {
		t.Errorf("no rules file: exit %d:\n%s", code, stdout)
	}
}

// bookTurn books the turn a parked task has under rule of the rules file
// at path, for subject: the rule's next, under the task's ID. It returns
// the turn's slot.
func bookTurn(t *testing.T, rdb *redis.Client, path, rule, subject, id string) time.Time {
	t.Helper()
	cfg, err := rules.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	lim, err := cfg.Limiter(rdb, rule, throttle.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var a throttle.Admission
	for _, id := range []string{"first", id} {
		if a, err = lim.Admit(context.Background(), throttle.AdmitRequest{Subject: subject, N: 1, Caller: throttle.Caller{ID: id}, Horizon: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	if a.Status != throttle.Booked {
		t.Fatalf("second admission %v, want booked", a.Status)
	}
	return a.Slot
}

// decodeExplanation decodes explain --json's output, which must hold no
// field that worker.Explanation lacks.
func decodeExplanation(t *testing.T, code int, stdout string) worker.Explanation {
	t.Helper()
	e := decodeExplanationOnly(t, code, stdout)
	for _, key := range []string{`"task_id"`, `"status": "pending"`, `"rule": {`, `"turn": "`, `"rules_known": true`} {
		if !strings.Contains(stdout, key) {
			t.Errorf("--json lacks %s:\n%s", key, stdout)
		}
	}
	return e
}

// decodeExplanationOnly decodes explain --json's output, which must hold
// no field that worker.Explanation lacks, and exit 0.
func decodeExplanationOnly(t *testing.T, code int, stdout string) worker.Explanation {
	t.Helper()
	var e worker.Explanation
	dec := json.NewDecoder(strings.NewReader(stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil || code != exitOK {
		t.Fatalf("--json: exit %d, %v:\n%s", code, err, stdout)
	}
	return e
}

// goRedisLog matches a line of go-redis's own logger.
var goRedisLog = regexp.MustCompile(`(?m)^redis: \d{4}/`)

// Each outcome of explain has its exit status and one line saying what
// to do; no password is echoed.
func TestBinaryExplainExitCodes(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	client := asynq.NewClientFromRedisClient(proc.Client(t))
	for _, q := range []string{"a", "b"} {
		if _, err := client.Enqueue(asynq.NewTask("t", nil), asynq.Queue(q), asynq.TaskID("dup")); err != nil {
			t.Fatal(err)
		}
	}
	locked := redistest.Server(t, redistest.Args("--requirepass", "right-password"))
	good := []string{"REDIS_URL=" + proc.URL()}
	bad := writeRules(t, "rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 0s}\n")
	cases := []struct {
		name string
		env  []string
		args []string
		code int
		want string
	}{
		{"found", good, []string{"--queue", "a", "dup"}, exitOK, ""},
		{"not found", good, []string{"nope"}, exitNotFound, `worker: explain: no task "nope" in queues "a", "b", nor a copy "nope~throttled1"`},
		{"in two queues", good, []string{"dup"}, exitUsage, `worker: explain: the task ID is in several queues: "dup" is in queues "a", "b"; name one (--queue)`},
		{"no ID", good, nil, exitUsage, "worker: explain: which task? Give its ID"},
		{"two IDs", good, []string{"a", "b"}, exitUsage, "worker: explain: one task ID at a time, not 2"},
		{"unknown flag", good, []string{"--bogus", "a"}, exitUsage, "flag provided but not defined: -bogus"},
		{"no Redis", nil, []string{"a"}, exitUsage, "worker: explain: no Redis: set REDIS_URL"},
		{"bad URL", []string{"REDIS_URL=hunter2"}, []string{"a"}, exitUsage, "worker: Redis URL (a Redis URL without scheme://)"},
		{"bad rules", good, []string{"--config", bad, "a"}, exitUsage, `:2: rule "r": period: "0s" must be at least 1µs`},
		{"missing rules", good, []string{"--config", filepath.Join(t.TempDir(), "none.yaml"), "a"}, exitUsage, "worker: reading the rules file: open"},
		{"Redis does not answer", []string{"REDIS_URL=redis://" + closedAddr + "/0?dial_timeout=100ms"}, []string{"a"}, exitError, "worker: Redis at redis://" + closedAddr + "/0?dial_timeout=100ms does not answer: "},
		{"wrong password", []string{"REDIS_URL=redis://:hunter2@" + locked.Addr() + "/0"}, []string{"a"}, exitError, "worker: Redis at redis://:xxxxx@" + locked.Addr() + "/0 answered with an error: WRONGPASS"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := cmdtest.Run(t, c.env, append([]string{"explain"}, c.args...)...)
			if code != c.code || !strings.Contains(stderr, c.want) || c.want == "" && stderr != "" {
				t.Errorf("worker explain %s: exit %d, stderr:\n%s\nwant exit %d and %q", strings.Join(c.args, " "), code, stderr, c.code, c.want)
			}
			for _, no := range []string{"worker: worker:", "hunter2", "panic"} {
				if strings.Contains(stderr, no) {
					t.Errorf("stderr holds %q:\n%s", no, stderr)
				}
			}
			if goRedisLog.MatchString(stderr) {
				t.Errorf("stderr holds go-redis's own log lines:\n%s", stderr)
			}
		})
	}
	if code, _, stderr := cmdtest.Run(t, nil, "explain", "-h"); code != exitOK || !strings.Contains(stderr, "usage: worker explain") {
		t.Errorf("-h: exit %d, stderr:\n%s", code, stderr)
	}
}
