package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
)

// --check shows a nested rule as the worker runs it: the tenant's
// subject and limit, each key a share of the line limited by the key's
// limit.
func TestCheckNested(t *testing.T) {
	cfg, err := rules.Parse("rules.yaml", []byte(`rules:
  - name: key
    tasks: ["api:*"]
    subject: {payload_field: api_key}
    algorithm: gcra
    limit: 10
    period: 1s
    within: tenant
    nested: true
  - name: tenant
    tasks: ["tenant:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 15
    period: 1s
`))
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	check(&b, cfg, &handler.Config{})
	for _, want := range []string{
		`rule "key" (line 2): tasks api:*; subject: payload field "tenant"; max_wait: 1s (the default)`,
		`  limit tenant: gcra, 15 per 1s, burst 15 (rule "tenant"'s)`,
		`  line: fair_by payload field "api_key"; share_limit 10 per 1s, burst 10`,
		`  within rule "tenant", nested: its tasks take turns of that rule's limits, each payload field "api_key" a share of its line limited by this rule's limit, in one atomic call; a task parks once`,
		`rule "tenant" (line 10): tasks tenant:*; subject: payload field "tenant"; max_wait: 1s (the default)`,
	} {
		if !strings.Contains(b.String(), want+"\n") {
			t.Errorf("--check lacks the line\n%s\n---\n%s", want, b.String())
		}
	}
}
