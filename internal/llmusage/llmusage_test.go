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

func TestParseAt(t *testing.T) {
	body := `{"meta": {"billed": [{"in": 120, "out": 45}], "neg": -1, "frac": 1.5, "name": "x"}, "in": 7}`
	for _, c := range []struct {
		in, out string
		want    Usage
		err     string
	}{
		{"meta.billed.0.in", "meta.billed.0.out", Usage{120, 45}, ""},
		{"in", "meta.billed.0.out", Usage{7, 45}, ""},
		{"meta.billed.1.in", "in", Usage{}, "meta.billed is an array of 1"},
		{"meta.nothing", "in", Usage{}, "has no meta.nothing"},
		{"in.deeper", "in", Usage{}, "has no in.deeper"},
		{"meta.neg", "in", Usage{}, "not a whole number"},
		{"meta.frac", "in", Usage{}, "not a whole number"},
		{"meta.name", "in", Usage{}, "not a whole number"},
	} {
		in, err := ParsePath(c.in)
		if err != nil {
			t.Fatal(err)
		}
		out, err := ParsePath(c.out)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseAt([]byte(body), in, out)
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s, %s: %+v, %v; want %+v, %q", c.in, c.out, got, err, c.want, c.err)
		}
	}
	if _, err := ParseAt([]byte("oops"), Path{"a"}, Path{"b"}); err == nil {
		t.Error("not JSON: no error")
	}
}

func TestParsePath(t *testing.T) {
	for _, c := range []struct{ s, err string }{
		{"usage.input_tokens", ""},
		{"data.0.x-y", ""},
		{"", "is empty"},
		{"usage..in", "each key"},
		{"usage.in[0]", "each key"},
		{".in", "each key"},
	} {
		p, err := ParsePath(c.s)
		if (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%q: %v; want %q", c.s, err, c.err)
		}
		if err == nil && p.String() != c.s {
			t.Errorf("%q: String %q", c.s, p)
		}
	}
}
