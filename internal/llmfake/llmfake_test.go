package llmfake

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestProvider sends two calls to a provider whose input limit holds one
// of them: the first is answered with its usage and the style's headers,
// the second with 429 and the wait until the input limit holds it.
func TestProvider(t *testing.T) {
	body := `{"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "` + strings.Repeat("word ", 80) + `"}]}`
	for _, c := range []struct {
		style          Style
		path, key, val string
		usage          string
		headers, on429 []string
	}{
		{OpenAI, "/v1/chat/completions", "Authorization", "Bearer k", `"prompt_tokens"`,
			[]string{"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests", "X-Ratelimit-Limit-Tokens"},
			[]string{"Retry-After", "Retry-After-Ms"}},
		{Anthropic, "/v1/messages", "X-Api-Key", "k", `"input_tokens"`,
			[]string{"Anthropic-Ratelimit-Requests-Reset", "Anthropic-Ratelimit-Input-Tokens-Remaining", "Anthropic-Ratelimit-Output-Tokens-Limit", "Anthropic-Ratelimit-Tokens-Limit"},
			[]string{"Retry-After"}},
	} {
		p := New(c.style, Limits{Requests: 100, Input: 150, Output: 1000, Tokens: 10000, Period: time.Minute}, 0)
		send := func() *httptest.ResponseRecorder {
			req := httptest.NewRequest(http.MethodPost, c.path, strings.NewReader(body))
			req.Header.Set(c.key, c.val)
			w := httptest.NewRecorder()
			p.ServeHTTP(w, req)
			return w
		}
		first := send()
		if first.Code != http.StatusOK || !strings.Contains(first.Body.String(), c.usage) {
			t.Fatalf("%s: first call %d %s; want 200 with %s", c.style, first.Code, first.Body, c.usage)
		}
		for _, h := range c.headers {
			if first.Header().Get(h) == "" {
				t.Errorf("%s: no %s header: %v", c.style, h, first.Header())
			}
		}
		second := send()
		if second.Code != http.StatusTooManyRequests {
			t.Fatalf("%s: second call %d; want 429 (the input limit holds one call)", c.style, second.Code)
		}
		for _, h := range c.on429 {
			if second.Header().Get(h) == "" || second.Header().Get(h) == "0" {
				t.Errorf("%s: 429 without %s: %v", c.style, h, second.Header())
			}
		}
		if s := p.Stats(); s.Answered != 1 || s.Rejected != 1 || s.RejectedBy[kInput] != 1 || s.Input < 85 || s.Input > 110 {
			t.Errorf("%s: stats %+v; want 1 answered with about 100 input tokens, 1 refused by the input limit", c.style, s)
		}
	}
}
