package handler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// An http handler with llm: true settles each call to its answer's usage,
// in OpenAI's shape and in Anthropic's: a policy of requests (1 a call),
// input tokens (estimated from the request's messages, bytes / 4) and
// output tokens (estimated from max_tokens) is charged the estimates when
// the task starts and, once the answer says what the call used, each
// token limit keeps only that. The token limits refill over a year, so
// that what is left is what was charged, whenever it is read.
func TestHTTPHandlerLLMUsage(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	for _, style := range []struct {
		name, usage string
		in, out     int    // what the answer says the call used (Anthropic: input + cache creation)
		paths       string // the handler's usage paths, for another shape
	}{
		{"openai", `{"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30}`, 21, 9, ""},
		{"anthropic", `{"input_tokens": 15, "cache_creation_input_tokens": 6, "cache_read_input_tokens": 500, "output_tokens": 9}`, 21, 9, ""},
		{"usage paths", `{"billed": [{"in": 21, "out": 9}]}`, 21, 9, "      usage: {input: usage.billed.0.in, output: usage.billed.0.out}\n"},
	} {
		t.Run(style.name, func(t *testing.T) {
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				fmt.Fprintf(w, `{"id": "x", "usage": %s}`, style.usage)
			}))
			t.Cleanup(api.Close)
			prefix := redistest.Prefix(t)
			file := fmt.Sprintf(`
prefix: %q
rules:
  - name: llm
    tasks: ["llm:chat"]
    subject: {fixed: provider}
    limits:
      - {name: requests, algorithm: gcra, limit: 100, period: 1h}
      - {name: input, algorithm: gcra, limit: 100000, period: 8760h, cost: {estimate: input_tokens}}
      - {name: output, algorithm: gcra, limit: 100000, period: 8760h, cost: {estimate: output_tokens}}
handlers:
  - task: llm:chat
    http:
      url: "%s/v1/chat/completions"
      llm: true
%s`, prefix, api.URL, style.paths)
			rc := runLLMCall(t, rdb, file, 400, "Say hello in one short sentence, please.")
			// The worker settles after the handler returns, just after the
			// task completes: wait for the input limit to show it.
			want := [3]int{99, 100000 - style.in, 100000 - style.out}
			var got [3]int
			for end := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				for i, l := range rc.Limits {
					lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, l)
					if err != nil {
						t.Fatal(err)
					}
					res, err := lim.AllowN(context.Background(), "provider", 0)
					if err != nil {
						t.Fatal(err)
					}
					got[i] = res.Remaining
				}
				if got == want || time.Now().After(end) {
					break
				}
			}
			if got != want {
				t.Errorf("remaining %v, want %v: requests 1, input and output settled to the usage", got, want)
			}
		})
	}
}

// runLLMCall runs one llm:chat task (max_tokens maxTokens, one user
// message) on a worker of the rules file, waits until it is done, and
// returns the file's first rule.
func runLLMCall(t *testing.T, rdb redis.UniversalClient, file string, maxTokens int, message string) rules.RuleConfig {
	t.Helper()
	fleet(t, rdb, file, 1, 2, func(string) string { return "" })
	payload, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": message}}})
	info, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask("llm:chat", payload), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if got := settle(t, asynq.NewInspectorFromRedisClient(rdb), []string{info.ID}, 20*time.Second)[info.ID]; got.State != asynq.TaskStateCompleted {
		t.Fatalf("task %v: %s", got.State, got.LastErr)
	}
	cfg, err := rules.Parse("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Rules[0]
}
