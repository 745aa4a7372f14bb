package rules

import (
	"strings"
	"testing"

	"github.com/jobthrottle/jobthrottle/throttle"
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

// TestWithinNested: a per-key rule within a per-tenant one, nested: its
// tasks become the tenant's, each key a share of the tenant's line limited
// by the key's limit, under the tenant's limits (the same keys) in a line
// of its own. A rule that cannot be nested is refused with the reason;
// without nested, within stacks the rules.
func TestWithinNested(t *testing.T) {
	const file = `rules:
  - name: key
    tasks: ["api:*"]
    subject: {payload_field: api_key}
    algorithm: gcra
    limit: 7
    period: 1s
    burst: 2
    within: tenant
    nested: true
  - name: tenant
    tasks: ["tenant:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 10
    period: 1s
%s`
	cfg, err := Parse("rules.yaml", []byte(strings.Replace(file, "%s", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	key, tenant := cfg.Rules[0], cfg.Rules[1]
	if !key.Nested || key.Subject != tenant.Subject || key.FairBy != (SubjectConfig{PayloadField: "api_key"}) {
		t.Errorf("nested rule: subject %+v, fair_by %+v; want the tenant's subject, its own as fair_by", key.Subject, key.FairBy)
	}
	if want := throttle.PerSecond(7).WithBurst(2); key.ShareLimit != want {
		t.Errorf("share_limit %+v, want its own limit %+v", key.ShareLimit, want)
	}
	if len(key.Limits) != 1 || key.Limits[0] != tenant.Limits[0] {
		t.Errorf("limits %+v, want the tenant's %+v", key.Limits, tenant.Limits)
	}
	if tenant.FairBy != (SubjectConfig{}) || tenant.ShareLimit != (throttle.Limit{}) {
		t.Errorf("the tenant's rule changed: %+v", tenant)
	}
	stacked, err := Parse("rules.yaml", []byte(strings.Replace(strings.Replace(file, "    nested: true\n", "", 1), "%s", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if r := stacked.Rules[0]; r.Nested || r.FairBy != (SubjectConfig{}) || r.Limits[0].Name != "key" {
		t.Errorf("within without nested: %+v, want the rule as written", r)
	}
	for _, tc := range []struct{ tail, want string }{
		{"    fair_by: {payload_field: user}\n", `rules.yaml:2: rule "key": nested: rule "tenant" has fair_by, share_limit or priority`},
		{"    cost: 2\n", `rules.yaml:2: rule "key": nested: this rule's cost and rule "tenant"'s differ`},
		{"    within: key\n", `comes back to it`},
	} {
		_, err := Parse("rules.yaml", []byte(strings.Replace(file, "%s", tc.tail, 1)))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("the tenant with %q: %v, want an error with %q", tc.tail, err, tc.want)
		}
	}
	window := strings.Replace(strings.Replace(file, "    algorithm: gcra\n", "    algorithm: fixed_window\n", 1), "    burst: 2\n", "", 1)
	if _, err := Parse("rules.yaml", []byte(strings.Replace(window, "%s", "", 1))); err == nil || !strings.Contains(err.Error(), "one limit, gcra or token_bucket") {
		t.Errorf("a nested fixed window: %v, want an error", err)
	}
	_, err = Parse("rules.yaml", []byte(strings.Replace(strings.Replace(file, "    within: tenant\n", "", 1), "%s", "", 1)))
	if want := `rule "key": nested: needs within`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("nested without within: %v, want an error with %q", err, want)
	}
}
