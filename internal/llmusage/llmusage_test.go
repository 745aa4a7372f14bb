package llmusage

import (
	"strings"
	"testing"
)

func TestEstimateInput(t *testing.T) {
	openai := `{"model": "m", "max_tokens": 300, "messages": [{"role": "user", "content": "` + strings.Repeat("word ", 100) + `"}]}`
	anthropic := `{"model": "m", "max_tokens": 300, "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}`
	for _, c := range []struct {
		name, payload string
		want          int
		err           string
	}{
		// [{"role": "user", "content": "word word ..."}] is 536 bytes.
		{"openai", openai, 134, ""},
		// "be brief" is 10 bytes, the messages 36: 46 bytes.
		{"anthropic with a system prompt", anthropic, 12, ""},
		{"no messages", `{"max_tokens": 3}`, 0, "no messages"},
		{"not an object", `[1]`, 0, "not a JSON object"},
	} {
		got, err := EstimateInput([]byte(c.payload))
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s: %d, %v; want %d, %q", c.name, got, err, c.want, c.err)
		}
	}
}

func TestMaxTokens(t *testing.T) {
	for _, c := range []struct {
		payload string
		want    int
		err     string
	}{
		{`{"max_tokens": 400}`, 400, ""},
		{`{"max_completion_tokens": 250}`, 250, ""},
		{`{"messages": []}`, 0, "no max_tokens"},
		{`{"max_tokens": 1.5}`, 0, "whole-number"},
		{`{"max_tokens": -1}`, 0, "want 0 to"},
	} {
		got, err := MaxTokens([]byte(c.payload))
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s: %d, %v; want %d, %q", c.payload, got, err, c.want, c.err)
		}
	}
}

func TestParse(t *testing.T) {
	for _, c := range []struct {
		name, body string
		want       Usage
		err        bool
	}{
		{"openai", `{"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 80, "total_tokens": 200, "prompt_tokens_details": {"cached_tokens": 100}}}`, Usage{120, 80}, false},
		{"anthropic", `{"content": [], "usage": {"input_tokens": 50, "output_tokens": 30}}`, Usage{50, 30}, false},
		{"anthropic, cache written and read", `{"usage": {"input_tokens": 50, "cache_creation_input_tokens": 1000, "cache_read_input_tokens": 4000, "output_tokens": 30}}`, Usage{1050, 30}, false},
		{"no usage", `{"choices": []}`, Usage{}, true},
		{"half a usage", `{"usage": {"prompt_tokens": 3}}`, Usage{}, true},
		{"not JSON", `oops`, Usage{}, true},
	} {
		got, err := Parse([]byte(c.body))
		if got != c.want || (err != nil) != c.err {
			t.Errorf("%s: %+v, %v; want %+v (error %v)", c.name, got, err, c.want, c.err)
		}
	}
	if got := (Usage{Input: 3, Output: 4}).Total(); got != 7 {
		t.Errorf("Total %d, want 7", got)
	}
}
