package rules

import (
	"strings"
	"testing"
)

// TestWithin reads a rule within another (a per-key limit within a
// per-tenant one), and refuses a within that names no rule or comes back
// to its rule, with the line and the field.
func TestWithin(t *testing.T) {
	const head = `rules:
  - name: key
    tasks: ["api:*"]
    subject: {payload_field: api_key}
    algorithm: gcra
    limit: 7
    period: 1s
    within: %s
  - name: tenant
    tasks: ["tenant:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 10
    period: 1s
`
	cfg, err := Parse("rules.yaml", []byte(strings.Replace(head, "%s", "tenant", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Rules[0].Within; got != "tenant" {
		t.Errorf("within %q, want tenant", got)
	}
	for _, tc := range []struct{ within, tail, want string }{
		{"nobody", "", `rules.yaml:2: rule "key": within: "nobody" is not a rule of this file`},
		{"tenant", "    within: key\n", `rules.yaml:2: rule "key": within: following within from rule "key" comes back to it`},
	} {
		_, err := Parse("rules.yaml", []byte(strings.Replace(head, "%s", tc.within, 1)+tc.tail))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("within %s: %v, want %q", tc.within, err, tc.want)
		}
	}
}
