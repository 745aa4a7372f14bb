package handler

import (
	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/internal/llmusage"
	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
)

// UsagePaths say where an LLM answer of another shape than OpenAI's or
// Anthropic's reports what the call used (HTTPSpec.Usage): the keys
// leading to each count, separated by dots, an array's elements by their
// index from 0, such as "usage.in" or "meta.billing.0.output_tokens".
//
//	http:
//	  url: "https://llm.example/v1/generate"
//	  llm: true
//	  usage: {input: meta.tokens.in, output: meta.tokens.out}
type UsagePaths struct {
	Input  string // the input (prompt) tokens
	Output string // the output (completion) tokens

	in, out llmusage.Path
}

// usage reads an http handler's usage paths, the mapping n at path.
func (p *parser) usage(n *yaml.Node, path string) (*UsagePaths, error) {
	u := &UsagePaths{}
	read := func(s *string, dst *llmusage.Path) yamlfile.ReadFunc {
		return func(v *yaml.Node, field string) error {
			var err error
			if *s, err = p.Str(v, field); err != nil {
				return err
			}
			if *dst, err = llmusage.ParsePath(*s); err != nil {
				return p.Failf(v, field, "%v", err)
			}
			return nil
		}
	}
	_, err := p.Fields(n, path, "usage", []yamlfile.Field{
		{Key: "input", Missing: "give the keys that lead to the input tokens in the answer, such as usage.input_tokens", Read: read(&u.Input, &u.in)},
		{Key: "output", Missing: "give the keys that lead to the output tokens in the answer, such as usage.output_tokens", Read: read(&u.Output, &u.out)},
	})
	return u, err
}

// parse reads the usage of an answer body: at the paths if set (in a
// handler parsed from a file), else in OpenAI's or Anthropic's shape.
func (u *UsagePaths) parse(body []byte) (llmusage.Usage, error) {
	if u == nil {
		return llmusage.Parse(body)
	}
	in, out := u.in, u.out
	if in == nil || out == nil { // built in code: parse what is written
		var err error
		if in, err = llmusage.ParsePath(u.Input); err != nil {
			return llmusage.Usage{}, err
		}
		if out, err = llmusage.ParsePath(u.Output); err != nil {
			return llmusage.Usage{}, err
		}
	}
	return llmusage.ParseAt(body, in, out)
}
