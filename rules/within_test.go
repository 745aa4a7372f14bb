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
// limiter holds both rules' limits (the tenant's Outer) and its subject is
// the key's nested in the tenant's, so one atomic call decides both. A
// rule that cannot be nested is refused with the reason; without nested,
// within stacks the rules.
func TestWithinNested(t *testing.T) {
	const file = `rules:
  - name: key
    tasks: ["api:*"]
    subject: {payload_field: api_key}
    algorithm: gcra
    limit: 7
    period: 1s
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
	if len(key.Limits) != 2 || key.Limits[0].Name != "key" || key.Limits[0].Outer ||
		key.Limits[1].Name != "tenant" || !key.Limits[1].Outer || key.Limits[1].Limit != tenant.Limits[0].Limit {
		t.Errorf("key's limits %+v, want its own, then the tenant's as Outer", key.Limits)
	}
	if len(tenant.Limits) != 1 || tenant.Limits[0].Outer || tenant.Subject.Outer != nil {
		t.Errorf("tenant's limits %+v, subject %+v: changed", tenant.Limits, tenant.Subject)
	}
	got, err := key.Subject.Of([]byte(`{"api_key": "k1", "tenant": "t1"}`))
	if want := throttle.Nest("t1", "k1"); err != nil || got != want {
		t.Errorf("key's subject %q, %v; want %q", got, err, want)
	}
	if _, err := key.Subject.Of([]byte(`{"api_key": "k1"}`)); err == nil {
		t.Errorf("a task without the tenant's field: no error")
	}
	stacked, err := Parse("rules.yaml", []byte(strings.Replace(strings.Replace(file, "    nested: true\n", "", 1), "%s", "", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if r := stacked.Rules[0]; r.Nested || len(r.Limits) != 1 || r.Subject.Outer != nil {
		t.Errorf("within without nested: %+v, want the rule as written", r)
	}
	for _, tc := range []struct{ tail, want string }{
		{"    fair_by: {payload_field: user}\n", `rules.yaml:2: rule "key": nested: rule "tenant" has fair_by or priority`},
		{"    cost: 2\n", `rules.yaml:2: rule "key": nested: this rule's cost and rule "tenant"'s differ`},
		{"    within: key\n", `comes back to it`},
	} {
		_, err := Parse("rules.yaml", []byte(strings.Replace(file, "%s", tc.tail, 1)))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("the tenant with %q: %v, want an error with %q", tc.tail, err, tc.want)
		}
	}
	_, err = Parse("rules.yaml", []byte(strings.Replace(strings.Replace(file, "    within: tenant\n", "", 1), "%s", "", 1)))
	if want := `rule "key": nested: needs within`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("nested without within: %v, want an error with %q", err, want)
	}
}
