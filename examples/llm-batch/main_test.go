package main

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/llmfake"
)

// TestBatch runs the README's command (the fake provider enforcing
// rules.yaml's limits, about 15s) in both provider styles and checks what
// the example promises: every call done once, no 429, the usage of every
// answer read, and the binding limit (input tokens) used: over 50 % of
// what it allowed from the first call to the last. The example prints
// 65-91 % (eight runs on a quiet 2-core machine, 2026-11-26: 12-21 s for
// the batch, the spread in the parked tasks' tail; the same on the
// commit before the day's merges); a loaded machine starts calls late,
// which lowers it and never causes a 429, the provider's buckets holding
// 12 seconds of each rate where the workers' bursts hold 10. 50 % still
// fails a pacing that collapses (a defect once paced the token limits at
// the request rate: 171 s instead of 18 s, under 10 %).
func TestBatch(t *testing.T) {
	for _, style := range []llmfake.Style{llmfake.OpenAI, llmfake.Anthropic} {
		t.Run(string(style), func(t *testing.T) {
			t.Parallel()
			cfg, err := fromEnv(defaults, func(name string) string {
				return map[string]string{"LLM_STYLE": string(style)}[name]
			})
			if err != nil {
				t.Fatal(err)
			}
			var out, logs bytes.Buffer
			res, err := run(context.Background(), cfg, &out, slog.New(slog.NewTextHandler(&logs, nil)))
			if err != nil {
				t.Fatalf("%v\n%s%s", err, out.String(), logs.String())
			}
			res.print(&out)
			t.Log("\n" + out.String())
			if res.Completed != cfg.Calls || res.Answered != cfg.Calls {
				t.Errorf("%d calls done, %d answered by the provider; want %d", res.Completed, res.Answered, cfg.Calls)
			}
			if res.Rejected != 0 {
				t.Errorf("the provider answered %d calls with 429; want none", res.Rejected)
			}
			if res.Input == 0 || res.Output == 0 {
				t.Errorf("usage read: %d input, %d output tokens; want both above 0", res.Input, res.Output)
			}
			if res.Binding != "llm.input" || res.Used[1] < 0.5 {
				t.Errorf("%s binds, input tokens used %.0f%% of what the limit allowed; want llm.input, at least 50%%", res.Binding, 100*res.Used[1])
			}
		})
	}
}

// TestKeyNeverShown runs the example against a provider that refuses its
// key (401): the call fails for good, and neither the error, the output
// nor the workers' logs show the key.
func TestKeyNeverShown(t *testing.T) {
	t.Parallel()
	const key = "sk-test-d0-not-print-me"
	var sent string
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent = strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		http.Error(w, `{"error": {"message": "Incorrect API key provided"}}`, http.StatusUnauthorized)
	}))
	t.Cleanup(api.Close)
	cfg, err := fromEnv(defaults, func(name string) string {
		return map[string]string{"LLM_BASE_URL": api.URL + "/v1", "LLM_API_KEY": key, "LLM_MODEL": "gpt-test"}[name]
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Calls, cfg.Timeout = 1, 20*time.Second
	var out, logs bytes.Buffer
	_, err = run(context.Background(), cfg, &out, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("error %v; want the call failed for good with the 401", err)
	}
	if sent != key {
		t.Errorf("the provider got key %q; want the one set", sent)
	}
	for what, s := range map[string]string{"error": err.Error(), "output": out.String(), "logs": logs.String()} {
		if strings.Contains(s, key) || strings.Contains(s, "d0-not-print") {
			t.Errorf("the %s shows the key:\n%s", what, s)
		}
	}
}

// TestFromEnv checks the environment's mistakes are refused with what to
// set.
func TestFromEnv(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"LLM_STYLE": "gemini"}, "use openai"},
		{map[string]string{"LLM_BASE_URL": "api.openai.com"}, "must start with http"},
		{map[string]string{"LLM_BASE_URL": "https://api.openai.com/v1"}, "LLM_API_KEY is not"},
		{map[string]string{"LLM_BASE_URL": "https://api.openai.com/v1", "LLM_API_KEY": "k"}, "set LLM_MODEL"},
	} {
		_, err := fromEnv(defaults, func(name string) string { return c.env[name] })
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v; want an error saying %q", c.env, err, c.want)
		}
	}
}
