package handler_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// An http handler with llm: true binds the limits its provider announces
// to the rule's limits that count the same thing, for every process: a
// rule configured far above the provider (6,000 requests and 600,000
// tokens a minute, bursts of 100 and 100,000) is decided, after one call,
// at 95 % of the provider's 60 requests and 6,000 input tokens a minute
// (bursts as much, capped at 95 % of what it says is left): 56 requests
// at once after the call's, 5 calls of 1,000 input tokens. OpenAI
// announces tokens, input and output together, which binds the input
// limit too; Anthropic its input tokens.
func TestHTTPHandlerLearnsProviderLimits(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	for _, style := range []llmfake.Style{llmfake.OpenAI, llmfake.Anthropic} {
		t.Run(string(style), func(t *testing.T) {
			api := httptest.NewServer(llmfake.New(style, llmfake.Limits{Requests: 60, Input: 6000, Output: 6000, Tokens: 6000, Period: time.Minute}, 0))
			t.Cleanup(api.Close)
			prefix := redistest.Prefix(t)
			file := fmt.Sprintf(`
prefix: %q
rules:
  - name: llm
    tasks: ["llm:chat"]
    subject: {fixed: provider}
    limits:
      - {name: requests, algorithm: gcra, limit: 6000, period: 1m, burst: 100}
      - {name: input, algorithm: gcra, limit: 600000, period: 1m, burst: 100000, cost: {estimate: input_tokens}}
      - {name: output, algorithm: gcra, limit: 600000, period: 1m, burst: 100000, cost: {estimate: output_tokens}}
handlers:
  - task: llm:chat
    http:
      url: "%s/v1/%s"
      headers: {Authorization: "Bearer k", X-Api-Key: k}
      llm: true
`, prefix, api.URL, map[llmfake.Style]string{llmfake.OpenAI: "chat/completions", llmfake.Anthropic: "messages"}[style])
			rc := runLLMCall(t, rdb, file, 20, "Say hello.")
			lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rc.Limits...)
			if err != nil {
				t.Fatal(err)
			}
			now := func(c throttle.Costs, tries int) int {
				n := 0
				for i := range tries {
					a, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "provider", Costs: c, Caller: throttle.Caller{ID: fmt.Sprint(c, i)}})
					if err != nil {
						t.Fatal(err)
					}
					if a.Status == throttle.Granted {
						n++
					}
				}
				return n
			}
			// The call took one request and a few input tokens: what the
			// provider says is left (59 requests), at 95 %, is what the rule
			// has left.
			if got := now(throttle.Costs{0, 1000, 0}, 7); got != 5 {
				t.Errorf("calls of 1,000 input tokens admitted at once: %d, want 5 (the provider's 6,000 a minute, at 95 %%)", got)
			}
			if got := now(throttle.Costs{1, 0, 0}, 100); got != 56 {
				t.Errorf("requests admitted at once: %d, want 56 (95 %% of the 59 the provider said were left)", got)
			}
		})
	}
}
