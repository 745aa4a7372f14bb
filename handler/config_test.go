package handler

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/rules"
)

const rulesHead = "rules:\n  - {name: r, tasks: [\"x\"], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n"

// Every mistake in the handlers section is a *rules.Error naming
// the line and the field, and saying what to write.
func TestParseConfigErrors(t *testing.T) {
	cases := []struct {
		name, handlers, want string
	}{
		{"not a list", "handlers: {task: x}", `rules.yaml:3: handlers: a mapping must be a list`},
		{"no task", "handlers:\n  - http: {url: \"https://a.example/\"}", `rules.yaml:4: handlers[1].task: missing`},
		{"pattern task", "handlers:\n  - {task: \"x:*\", command: {argv: [ls]}}", `handlers[1].task: "x:*": give one exact task type`},
		{"duplicate", "handlers:\n  - {task: x, command: {argv: [ls]}}\n  - {task: x, command: {argv: [ls]}}", `rules.yaml:5: handlers[2].task: "x" also has the handler on line 4`},
		{"neither", "handlers:\n  - {task: x}", `handlers[1]: needs http (call an API) or command (run a program)`},
		{"both", "handlers:\n  - {task: x, command: {argv: [ls]}, http: {url: \"https://a.example\"}}", `handlers[1].command: cannot be combined with http`},
		{"unknown field", "handlers:\n  - {task: x, command: {argv: [ls], shell: true}}", `unknown field "shell" in command`},
		{"host placeholder", "handlers:\n  - {task: x, http: {url: \"https://{host}/v1\"}}", `handlers[1].http.url: "https://{host}/v1": the host must be written out`},
		{"userinfo", "handlers:\n  - {task: x, http: {url: \"https://u:p@a.example/v1\"}}", `no user:password@`},
		{"scheme", "handlers:\n  - {task: x, http: {url: \"ftp://a.example/v1\"}}", `must start with http:// or https://`},
		{"fragment", "handlers:\n  - {task: x, http: {url: \"https://a.example/v1#{id}\"}}", `no #fragment`},
		{"method", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", method: get}}", `"get": use GET, POST, PUT, PATCH or DELETE`},
		{"header env", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", headers: {A: \"${1X}\"}}}", `handlers[1].http.headers.A: "${1X}" is not an environment variable reference`},
		{"header newline", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", headers: {A: \"a\\nb\"}}}", `must be one line`},
		{"timeout", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", timeout: 0s}}", `handlers[1].http.timeout: "0s" must be at least 1ms`},
		{"program placeholder", "handlers:\n  - {task: x, command: {argv: [\"{prog}\"]}}", `handlers[1].command.argv[1]: "{prog}": the program must be a literal`},
		{"partial placeholder", "handlers:\n  - {task: x, command: {argv: [ls, \"--t={t}\"]}}", `handlers[1].command.argv[2]: "--t={t}": a payload field fills a whole argument only`},
		{"exit code", "handlers:\n  - {task: x, command: {argv: [ls], no_retry_exit_codes: [0]}}", `no_retry_exit_codes: "0" must be a whole number from 1 to 255`},
		{"stop grace", "handlers:\n  - {task: x, command: {argv: [ls], stop_grace: 11m}}", `handlers[1].command.stop_grace: "11m" must be at most 10m0s`},
		{"stop grace unit", "handlers:\n  - {task: x, command: {argv: [ls], stop_grace: 5}}", `handlers[1].command.stop_grace: "5" must be a duration with a unit`},
		{"idempotency header name", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", idempotency_header: \"Idem Key\"}}", `handlers[1].http.idempotency_header: "Idem Key" is not a valid header name`},
		{"idempotency header empty", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", idempotency_header: }}", `handlers[1].http.idempotency_header: an empty value: write "" to send no idempotency header`},
		{"idempotency header also set", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", headers: {idempotency-key: k}}}", `handlers[1].http.headers.Idempotency-Key: is the idempotency header, which carries the task ID`},
		{"custom idempotency header also set", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", idempotency_header: x-request-id, headers: {X-Request-ID: k}}}", `handlers[1].http.headers.X-Request-Id: is the idempotency header`},
		{"usage without llm", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", usage: {input: a, output: b}}}", `rules.yaml:4: handlers[1].http.usage: needs llm: true`},
		{"limit window without llm", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", limit_window: 10s}}", `rules.yaml:4: handlers[1].http.limit_window: needs llm: true`},
		{"usage without output", "handlers:\n  - task: x\n    http:\n      url: \"https://a.example/\"\n      llm: true\n      usage: {input: a}", `rules.yaml:8: handlers[1].http.usage.output: missing; give the keys that lead to the output tokens`},
		{"usage path", "handlers:\n  - task: x\n    http:\n      url: \"https://a.example/\"\n      llm: true\n      usage:\n        input: \"a[0]\"\n        output: b", `rules.yaml:9: handlers[1].http.usage.input: "a[0]": each key between dots`},
		{"usage not a string", "handlers:\n  - {task: x, http: {url: \"https://a.example/\", llm: true, usage: {input: [a], output: b}}}", `handlers[1].http.usage.input: a list must be a string`},
		{"result limit", "handlers:\n  - {task: x, result_limit: 2000000, command: {argv: [ls]}}", `result_limit: "2000000" must be a whole number from 0 to 1048576`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			data := []byte(rulesHead + c.handlers + "\n")
			cfg, err := rules.Parse("rules.yaml", data)
			if err != nil {
				t.Fatalf("rules.Parse refuses the handlers section: %v", err)
			}
			_, err = ParseConfig("rules.yaml", data)
			var ce *rules.Error
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v; want a *rules.Error containing %q", err, c.want)
			}
			if _, fromRules := FromRules(cfg); fromRules == nil || fromRules.Error() != err.Error() {
				t.Errorf("FromRules: %v; want ParseConfig's %v", fromRules, err)
			}
		})
	}
}

func TestParseConfigDefaultsAndDescribe(t *testing.T) {
	data := []byte(rulesHead + `handlers:
  - task: partner:sync
    http:
      url: "https://api.example.com/v1/a/{id}?q={q}"
      headers: {Authorization: "Bearer ${TOKEN}", Accept: application/json}
  - task: report:render
    command: {argv: [render, "{tenant}"], env: {KEY: "${KEY}"}}
  - task: partner:ping
    http: {method: GET, url: "https://api.example.com/ping", idempotency_header: ""}
  - task: report:now
    command: {argv: [render], stop_grace: 0s}
  - task: llm:other
    http: {url: "https://llm.example/v1/generate", llm: true, usage: {input: meta.in, output: meta.out}}
`)
	c, err := ParseConfig("rules.yaml", data)
	if err != nil {
		t.Fatal(err)
	}
	// A worker parses the file once (rules.Parse) and reads the handlers
	// from what it read: the same Config.
	cfg, err := rules.Parse("rules.yaml", data)
	if err != nil {
		t.Fatal(err)
	}
	if fromRules, err := FromRules(cfg); err != nil || !reflect.DeepEqual(fromRules, c) {
		t.Errorf("FromRules = %+v, %v; want ParseConfig's %+v", fromRules, err, c)
	}
	h, ok := c.Handler("partner:sync")
	if !ok || h.HTTP.Method != "POST" || h.HTTP.Timeout != DefaultHTTPTimeout || h.ResultLimit != DefaultResultLimit {
		t.Fatalf("http defaults: %+v", h)
	}
	got := h.Describe()
	want := `http POST https://api.example.com/v1/a/{id}?q={q}, timeout 30s, task ID in Idempotency-Key, headers: Authorization from ${TOKEN}; Accept, result up to 65536 bytes`
	if got != want {
		t.Errorf("Describe:\n got %s\nwant %s", got, want)
	}
	cmd, _ := c.Handler("report:render")
	off, _ := c.Handler("partner:ping")
	if got, want := off.Describe(), `http GET https://api.example.com/ping, timeout 30s, no idempotency header, result up to 65536 bytes`; got != want {
		t.Errorf("Describe:\n got %s\nwant %s", got, want)
	}
	now, _ := c.Handler("report:now")
	if got, want := now.Describe(), `command ["render"], timeout 1m0s, SIGKILL 0s after SIGTERM, no retry on exit codes [65], result up to 65536 bytes`; got != want {
		t.Errorf("Describe:\n got %s\nwant %s", got, want)
	}
	if got, want := cmd.Describe(), `command ["render" "{tenant}"], timeout 1m0s, SIGKILL 5s after SIGTERM, env: KEY from ${KEY}, no retry on exit codes [65], result up to 65536 bytes`; got != want {
		t.Errorf("Describe:\n got %s\nwant %s", got, want)
	}
	other, _ := c.Handler("llm:other")
	if got, want := other.Describe(), `http POST https://llm.example/v1/generate, timeout 30s, task ID in Idempotency-Key, an LLM call settled to its answer's usage (input tokens at meta.in, output tokens at meta.out), result up to 65536 bytes`; got != want {
		t.Errorf("Describe:\n got %s\nwant %s", got, want)
	}
	if h.HTTP.IdempotencyHeader != DefaultIdempotencyHeader || cmd.Command.StopGrace != DefaultStopGrace {
		t.Errorf("idempotency header %q, stop grace %v; want the defaults", h.HTTP.IdempotencyHeader, cmd.Command.StopGrace)
	}
	if err := c.Register(asynq.NewServeMux(), Options{Getenv: func(string) string { return "" }}); err == nil || !strings.Contains(err.Error(), "environment variable TOKEN is not set") {
		t.Errorf("Register with TOKEN unset: %v", err)
	}
}
