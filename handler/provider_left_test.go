package handler

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// A provider's budget is also spent by another client of the same key:
// what the provider says is left, read from an answer when little is
// left, shows as later admissions of the fleet's next calls instead of as
// 429s. Before, the first answer's lesson was the only one (the limits
// did not change): the rule believed it had most of its budget, and a
// burst of calls after the other client's spending was answered 429. On
// virtual time: a provider of 6,000 input tokens a minute, the rule
// configured at it, calls of about 500.
func TestProviderLearnerReadsWhatIsLeft(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		cfg, err := rules.Parse("rules.yaml", []byte(`
prefix: "left:"
rules:
  - name: llm
    tasks: ["llm:chat"]
    subject: {fixed: provider}
    limits:
      - {name: requests, algorithm: gcra, limit: 600, period: 1m, burst: 600}
      - {name: input, algorithm: gcra, limit: 6000, period: 1m, burst: 6000, cost: {estimate: input_tokens}}
`))
		if err != nil {
			t.Fatal(err)
		}
		lim, err := cfg.Limiter(rdb, "llm", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		p := newProviderLearner(lim, cfg.Rules[0], time.Minute, slog.New(slog.DiscardHandler))
		fake := llmfake.New(llmfake.Anthropic, llmfake.Limits{Requests: 600, Input: 6000, Period: time.Minute}, 0)
		call := func(content string) *httptest.ResponseRecorder {
			body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 10,
				"messages": []map[string]string{{"role": "user", "content": content}}})
			req := httptest.NewRequest(http.MethodPost, "http://llm/v1/messages", strings.NewReader(string(body)))
			req.Header.Set("X-Api-Key", "k")
			w := httptest.NewRecorder()
			fake.ServeHTTP(w, req)
			return w
		}
		// ours runs n calls of the fleet at once, each when the rule
		// admits it, and returns how many were answered and refused.
		ours := func(n int) (answered, refused int) {
			done := make(chan int, n)
			for range n {
				go func() {
					r, err := lim.ReserveCosts(ctx, "provider", throttle.Costs{1, 500})
					if err != nil {
						t.Error(err)
						done <- 0
						return
					}
					time.Sleep(r.Delay())
					w := call(strings.Repeat("y", 1900))
					p.learn(ctx, "provider", w.Header())
					actual := throttle.Costs{1, 0}
					if w.Code == http.StatusOK {
						var a struct {
							Usage struct {
								InputTokens int `json:"input_tokens"`
							}
						}
						_ = json.Unmarshal(w.Body.Bytes(), &a)
						actual[1] = a.Usage.InputTokens
					}
					if err := r.SettleCosts(ctx, actual); err != nil {
						t.Error(err)
					}
					done <- w.Code
				}()
			}
			for range n {
				if <-done == http.StatusOK {
					answered++
				} else {
					refused++
				}
			}
			return answered, refused
		}
		ours(1) // the first answer: the limits, and what is left
		time.Sleep(10 * time.Second)
		if w := call(strings.Repeat("x", 20000)); w.Code != http.StatusOK { // the other client: about 5,000 tokens
			t.Fatalf("the other client's call: %d", w.Code)
		}
		time.Sleep(time.Second)
		ours(1) // answered, and says that little is left
		time.Sleep(time.Second)
		start := time.Now()
		answered, refused := ours(6)
		if refused > 0 {
			t.Errorf("%d of 6 calls answered 429 after another client spent most of the budget; want none: what is left was not read", refused)
		}
		// What is left (about 1,300 tokens) at once, then the rate: the
		// sixth call's tokens come about 20 s later.
		if took := time.Since(start); answered == 6 && took < 15*time.Second {
			t.Errorf("6 calls answered in %v; want the rate's time", took)
		}
	})
}
