package rules

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/llmusage"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const validConfig = `# rules for the billing workers
prefix: "billing:"
fail_open: true
rules:
  - name: stripe
    tasks: ["stripe:*", "invoice:send"]
    subject: {payload_field: account_id}
    algorithm: gcra
    limit: 20
    period: 1s
    burst: 5
    max_wait: 30s
  - name: tenant-policy
    tasks: ["report:*"]
    subject: {payload_field: tenant}
    max_wait: 2s
    limits:
      - {name: per10s, algorithm: sliding_window, limit: 200, period: 10s, precision: 500ms}
      - {name: hourly, algorithm: fixed_window, limit: 5000, period: 1h}
  - name: global
    tasks: ["*"]
    subject: {fixed: global}
    algorithm: leaky-bucket
    limit: 1000
    period: 1m
    wait_slots: 4
    cost: {payload_field: recipients}
`

func TestParse(t *testing.T) {
	c, err := Parse("rules.yaml", []byte(validConfig))
	if err != nil {
		t.Fatal(err)
	}
	want := &Config{
		File: "rules.yaml", Prefix: "billing:", FailOpen: true,
		Rules: []RuleConfig{
			{
				Name: "stripe", Tasks: []string{"stripe:*", "invoice:send"}, Subject: SubjectConfig{PayloadField: "account_id"},
				Limits:   []throttle.Rule{{Name: "stripe", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 20, Period: time.Second, Burst: 5}}},
				Settings: admission.Settings{MaxWait: 30 * time.Second}, Line: 5,
			},
			{
				Name: "tenant-policy", Tasks: []string{"report:*"}, Subject: SubjectConfig{PayloadField: "tenant"},
				Limits: []throttle.Rule{
					{Name: "tenant-policy.per10s", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 200, Period: 10 * time.Second, Burst: 200}, Precision: 500 * time.Millisecond},
					{Name: "tenant-policy.hourly", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 5000, Period: time.Hour, Burst: 5000}},
				},
				Settings: admission.Settings{MaxWait: 2 * time.Second}, Line: 13,
			},
			{
				Name: "global", Tasks: []string{"*"}, Subject: SubjectConfig{Fixed: "global"},
				Limits:   []throttle.Rule{{Name: "global", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1000, Period: time.Minute, Burst: 1000}}},
				Settings: admission.Settings{WaitSlots: 4}, Cost: CostConfig{PayloadField: "recipients"}, Line: 20,
			},
		},
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("ParseConfig =\n%+v\nwant\n%+v", c, want)
	}
	for typ, rule := range map[string]string{"stripe:charge": "stripe", "invoice:send": "stripe", "report:daily": "tenant-policy", "email:send": "global"} {
		if r, ok := c.RuleFor(typ); !ok || r.Name != rule {
			t.Errorf("RuleFor(%q) = %q, %v; want %q", typ, r.Name, ok, rule)
		}
	}

	min, err := Parse("min.yaml", []byte("rules: [{name: a, tasks: [a], subject: {fixed: x}, algorithm: token_bucket, limit: 1, period: 1h}]"))
	if err != nil {
		t.Fatal(err)
	}
	if min.Prefix != throttle.DefaultPrefix || min.FailOpen || min.Rules[0].MaxWait != 0 || min.Rules[0].Limits[0].Limit.Burst != 1 {
		t.Errorf("defaults: %+v", min)
	}
}

func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rules.yaml")
	if err := os.WriteFile(path, []byte(strings.Replace(validConfig, "limit: 20", "limit: 0", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Load(path)
	var ce *Error
	if !errors.As(err, &ce) || ce.File != path || ce.Line != 9 || ce.Kind != "rule" || ce.Name != "stripe" || ce.Field != "limit" {
		t.Errorf("got %v; want a *Error at %s:9, rule stripe, field limit", err, path)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("missing file: %v", err)
	}
}

// rule is a valid rule body, indented for the rules list; tests replace
// lines of it.
const rule = `rules:
  - name: stripe
    tasks: ["stripe:*"]
    subject: {payload_field: account_id}
    algorithm: gcra
    limit: 20
    period: 1s
`

func TestParseErrors(t *testing.T) {
	edit := func(old, new string) string {
		if !strings.Contains(rule, old) {
			panic("test edit: " + old)
		}
		return strings.Replace(rule, old, new, 1)
	}
	policy := func(limits string) string {
		return "rules:\n  - name: p\n    tasks: [r]\n    subject: {fixed: x}\n    limits:\n" + limits
	}
	const fair = "    fair_by: {payload_field: tenant}\n"
	for _, tc := range []struct {
		name, yaml, want string
	}{
		// The file as a whole.
		{"empty", "", `rules.yaml: the file is empty; it needs a rules list (see rules/README.md)`},
		{"comments only", "# nothing\n", `rules.yaml: the file is empty; it needs a rules list (see rules/README.md)`},
		{"syntax", "rules:\n  - name: a\n    tasks: [b\n", `rules.yaml:2: invalid YAML: did not find expected ',' or ']'`},
		{"bad indent", "rules:\n  - name: a\n   tasks: [b]\n", `rules.yaml:1: invalid YAML: did not find expected '-' indicator`}, // the line yaml reports
		{"tab indent", "rules:\n\t- name: a\n", `rules.yaml:2: invalid YAML: found character that cannot start any token`},
		{"two documents", rule + "---\nrules: []\n", `rules.yaml:8: a second YAML document; a rules file holds one`},
		{"not a mapping", "- a\n- b\n", `rules.yaml:1: the file must be a mapping with the fields prefix, fail_open, budgets, rules, handlers`},
		{"scalar", "hello\n", `rules.yaml:1: the file must be a mapping with the fields prefix, fail_open, budgets, rules, handlers`},
		{"unknown top-level", "prefx: a\n" + rule, `rules.yaml:1: unknown field "prefx" in the file; allowed: prefix, fail_open, budgets, rules, handlers`},
		{"repeated top-level", "prefix: a\nprefix: b\n" + rule, `rules.yaml:2: prefix: repeats the field set on line 1; give it once`},
		{"no rules", "prefix: a\n", `rules.yaml:1: rules: missing; list at least one rule`},
		{"empty rules", "rules: []\n", `rules.yaml:1: rules: a list must be a list of at least one rule`},
		{"rules mapping", "rules: {a: 1}\n", `rules.yaml:1: rules: a mapping must be a list of at least one rule`},
		{"null rules", "rules:\n", `rules.yaml:1: rules: an empty value must be a list of at least one rule`},
		{"prefix braces", "prefix: \"a{b}\"\n" + rule, `rules.yaml:1: prefix: "a{b}" must not contain '{' or '}', which delimit the subject's hash tag`},
		{"prefix empty", "prefix: \"\"\n" + rule, `rules.yaml:1: prefix: must not be empty; leave it out for "jobthrottle:"`},
		{"prefix number", "prefix: 12\n" + rule, `rules.yaml:1: prefix: "12" must be a string`},
		{"fail_open string", "fail_open: \"yes\"\n" + rule, `rules.yaml:1: fail_open: "yes" must be true or false`},
		{"fail_open word", "fail_open: maybe\n" + rule, `rules.yaml:1: fail_open: "maybe" must be true or false`},

		// A rule's own fields.
		{"rule not a mapping", "rules: [stripe]\n", `rules.yaml:1: rule #1: a rule must be a mapping with the fields name, tasks, subject, algorithm, limit, period, burst, precision, lease, max_wait, wait_slots, cost, budget, limits`},
		{"unknown rule field", edit("    period: 1s\n", "    perod: 1s\n"), `rules.yaml:7: rule #1: unknown field "perod" in a rule; allowed: name, tasks, subject, algorithm, limit, period, burst, precision, lease, max_wait, wait_slots, cost, budget, limits`},
		{"repeated rule field", edit("    limit: 20\n", "    limit: 20\n    limit: 30\n"), `rules.yaml:7: rule #1: limit: repeats the field set on line 6; give it once`},
		{"no name", edit("  - name: stripe\n    tasks", "  - tasks"), `rules.yaml:2: rule #1: name: missing; give the rule a name (letters, digits, '-' and '_' only, at most 64)`},
		{"bad name", edit("name: stripe", "name: stripe.v2"), `rules.yaml:2: rule #1: name: "stripe.v2": use letters, digits, '-' and '_' only, at most 64`},
		{"long name", edit("name: stripe", "name: "+strings.Repeat("a", 65)), `rules.yaml:2: rule #1: name: "` + strings.Repeat("a", 65) + `": use letters`},
		{"name list", edit("name: stripe", "name: [a]"), `rules.yaml:2: rule #1: name: a list must be a string`},
		{"duplicate name", rule + strings.Replace(rule[len("rules:\n"):], "stripe:*", "other", 1), `rules.yaml:8: rule #2: name: "stripe" is also the name of the rule on line 2; names must be unique`},
		{"no tasks", edit("    tasks: [\"stripe:*\"]\n", ""), `rules.yaml:2: rule "stripe": tasks: missing; list the task types the rule applies to, such as ["email:send", "stripe:*"]`},
		{"empty tasks", edit(`["stripe:*"]`, "[]"), `rules.yaml:3: rule "stripe": tasks: a list must be a list of at least one task type or pattern`},
		{"tasks string", edit(`["stripe:*"]`, `"stripe:*"`), `rules.yaml:3: rule "stripe": tasks: "stripe:*" must be a list of at least one task type or pattern`},
		{"empty pattern", edit(`["stripe:*"]`, `[""]`), `rules.yaml:3: rule "stripe": tasks: pattern "" is empty; give a task type such as "email:send" or a prefix pattern such as "stripe:*"`},
		{"inner star", edit(`["stripe:*"]`, `["stripe:*:charge"]`), `rules.yaml:3: rule "stripe": tasks: pattern "stripe:*:charge": '*' may only end a pattern, as in "stripe:*"`},
		{"task not string", edit(`["stripe:*"]`, `[{a: b}]`), `rules.yaml:3: rule "stripe": tasks: a mapping must be a string`},
		{"task twice", edit(`["stripe:*"]`, `["a", "a"]`), `rules.yaml:3: rule "stripe": tasks: "a" is listed twice`},
		{"task in two rules", rule + strings.Replace(rule[len("rules:\n"):], "name: stripe", "name: other", 1), `rules.yaml:9: rule "other": tasks: "stripe:*" is also in rule "stripe"; a task type takes one rule`},

		// Subjects.
		{"no subject", edit("    subject: {payload_field: account_id}\n", ""), `rules.yaml:2: rule "stripe": subject: missing; give {payload_field: <JSON field>} or {fixed: <subject>}`},
		{"subject string", edit("{payload_field: account_id}", "account_id"), `rules.yaml:4: rule "stripe": subject: subject must be a mapping with the fields fixed, payload_field`},
		{"subject both", edit("{payload_field: account_id}", "{payload_field: a, fixed: b}"), `rules.yaml:4: rule "stripe": subject: give {payload_field: <JSON field>} or {fixed: <subject>}, exactly one of them`},
		{"subject neither", edit("{payload_field: account_id}", "{}"), `rules.yaml:4: rule "stripe": subject: give {payload_field: <JSON field>} or {fixed: <subject>}, exactly one of them`},
		{"subject unknown", edit("{payload_field: account_id}", "{header: tenant}"), `rules.yaml:4: rule "stripe": subject: unknown field "header" in subject; allowed: fixed, payload_field`},
		{"fixed empty", edit("{payload_field: account_id}", `{fixed: ""}`), `rules.yaml:4: rule "stripe": subject.fixed: "": throttle: invalid subject: empty`},
		{"fixed number", edit("{payload_field: account_id}", `{fixed: 7}`), `rules.yaml:4: rule "stripe": subject.fixed: "7" must be a string`},
		{"payload field empty", edit("{payload_field: account_id}", `{payload_field: ""}`), `rules.yaml:4: rule "stripe": subject.payload_field: must name a top-level field of the JSON payload, such as "tenant_id"`},

		// A single limit.
		{"no algorithm", edit("    algorithm: gcra\n", ""), `rules.yaml:2: rule "stripe": algorithm: missing; one of fixed_window, sliding_log, sliding_window, token_bucket, gcra`},
		{"unknown algorithm", edit("algorithm: gcra", "algorithm: leaky"), `rules.yaml:5: rule "stripe": algorithm: "leaky" is not one of fixed_window, sliding_log, sliding_window, token_bucket, gcra (or leaky_bucket)`},
		{"no limit", edit("    limit: 20\n", ""), `rules.yaml:2: rule "stripe": limit: missing; how many tasks per period, such as 20`},
		{"limit zero", edit("limit: 20", "limit: 0"), `rules.yaml:6: rule "stripe": limit: "0" must be a whole number, at least 1`},
		{"limit negative", edit("limit: 20", "limit: -5"), `rules.yaml:6: rule "stripe": limit: "-5" must be a whole number, at least 1`},
		{"limit float", edit("limit: 20", "limit: 2.5"), `rules.yaml:6: rule "stripe": limit: "2.5" must be a whole number, at least 1`},
		{"limit string", edit("limit: 20", `limit: "20"`), `rules.yaml:6: rule "stripe": limit: "20" must be a whole number, at least 1`},
		{"limit huge", edit("limit: 20", "limit: 99999999999999999999999"), `rules.yaml:6: rule "stripe": limit: "99999999999999999999999" is too large: at most 1099511627776`},
		{"limit too large", edit("limit: 20", "limit: 2000000000000"), `rules.yaml:6: rule "stripe": limit: "2000000000000" is too large: at most 1099511627776`},
		{"burst huge", rule + "    burst: 99999999999999999999999\n", `rules.yaml:8: rule "stripe": burst: "99999999999999999999999" is too large: at most 1099511627776`},
		{"limit null", edit("limit: 20", "limit:"), `rules.yaml:6: rule "stripe": limit: an empty value must be a whole number, at least 1`},
		{"no period", edit("    period: 1s\n", ""), `rules.yaml:2: rule "stripe": period: missing; a duration such as 1s, 1m or 1h`},
		{"period zero", edit("period: 1s", "period: 0s"), `rules.yaml:7: rule "stripe": period: "0s" must be at least 1µs`},
		{"period no unit", edit("period: 1s", "period: 1"), `rules.yaml:7: rule "stripe": period: "1" must be a duration with a unit, such as 1s, 500ms or 1h`},
		{"period negative", edit("period: 1s", "period: -1s"), `rules.yaml:7: rule "stripe": period: "-1s" must be at least 1µs`},
		{"period garbage", edit("period: 1s", "period: soon"), `rules.yaml:7: rule "stripe": period: "soon" is not a duration; write a number and a unit (ns, us, ms, s, m, h), such as 1s, 500ms or 1h`},
		{"period days", edit("period: 1s", "period: 1d"), `rules.yaml:7: rule "stripe": period: "1d" is not a duration`},
		{"period too long", edit("period: 1s", "period: 100000h"), `rules.yaml:7: rule "stripe": period: 100000h0m0s must be at most 87600h0m0s`},
		{"period nanoseconds", edit("period: 1s", "period: 1500ns"), `rules.yaml:7: rule "stripe": period: "1500ns" must be a whole number of microseconds`},
		{"burst zero", rule + "    burst: 0\n", `rules.yaml:8: rule "stripe": burst: "0" must be a whole number, at least 1`},
		{"burst horizon", edit("period: 1s", "period: 87600h") + "    burst: 40\n", `rules.yaml:8: rule "stripe": burst: 40 burst × period / count must be at most 87600h0m0s`},
		{"burst on a window", edit("algorithm: gcra", "algorithm: fixed_window") + "    burst: 5\n", `rules.yaml:8: rule "stripe": burst: applies only to token_bucket and gcra; fixed_window admits limit per period`},
		{"precision elsewhere", rule + "    precision: 100ms\n", `rules.yaml:8: rule "stripe": precision: applies only to sliding_window`},
		{"precision over period", edit("algorithm: gcra", "algorithm: sliding_window") + "    precision: 2s\n", `rules.yaml:8: rule "stripe": precision: "2s" must not exceed the period 1s`},
		{"precision zero", edit("algorithm: gcra", "algorithm: sliding_window") + "    precision: 0s\n", `rules.yaml:8: rule "stripe": precision: "0s" must be at least 1µs`},
		{"too many buckets", edit("algorithm: gcra", "algorithm: sliding_window") + "    precision: 10us\n", `rules.yaml:8: rule "stripe": precision: 10µs gives more than 10000 buckets per period 1s`},
		{"max_wait negative", rule + "    max_wait: -1s\n", `rules.yaml:8: rule "stripe": max_wait: "-1s" must be at least 0s`},
		{"max_wait number", rule + "    max_wait: 30\n", `rules.yaml:8: rule "stripe": max_wait: "30" must be a duration with a unit`},
		{"cost zero", rule + "    cost: 0\n", `rules.yaml:8: rule "stripe": cost: "0" must be a whole number from 1 to 1073741824`},
		{"cost over burst", rule + "    burst: 5\n    cost: 6\n", `rules.yaml:9: rule "stripe": cost: 6 permits per task, but limit "stripe" admits at most 5 at once; raise its burst or lower the cost`},
		{"cost unknown field", rule + "    cost: {field: n}\n", `rules.yaml:8: rule "stripe": cost: unknown field "field" in cost; allowed: payload_field`},
		{"cost empty field", rule + "    cost: {payload_field: \"\"}\n", `rules.yaml:8: rule "stripe": cost.payload_field: must name a top-level field of the JSON payload, such as "recipients"`},
		{"wait_slots negative", rule + "    wait_slots: -1\n", `rules.yaml:8: rule "stripe": wait_slots: "-1" must be a whole number from 0 to 10000`},
		{"horizon zero", rule + "    horizon: 0s\n", `rules.yaml:8: rule "stripe": horizon: "0s" must be at least 1ms`},
		{"horizon too long", rule + "    horizon: 48h\n", `rules.yaml:8: rule "stripe": horizon: "48h" must be at most 24h0m0s`},
		{"weights without fair_by", rule + "    weights: {gold: 3}\n", `rules.yaml:8: rule "stripe": weights: weigh the shares of fair_by; set fair_by too`},
		{"weight zero", rule + "    fair_by: {payload_field: tenant}\n    weights: {gold: 0}\n", `rules.yaml:9: rule "stripe": weights.gold: "0" must be a whole number from 1 to 1000`},
		{"weights a list", rule + "    fair_by: {payload_field: tenant}\n    weights: [3]\n", `rules.yaml:9: rule "stripe": weights: a list must be a mapping of share to weight`},
		{"fair_by empty", rule + "    fair_by: {}\n", `rules.yaml:8: rule "stripe": fair_by`},
		{"share_limit without fair_by", rule + "    share_limit: {limit: 10, period: 1s}\n", `rules.yaml:8: rule "stripe": share_limit: limits each share of fair_by; set fair_by too`},
		{"share_limit no period", rule + fair + "    share_limit: {limit: 10}\n", `rules.yaml:9: rule "stripe": share_limit.period: missing; share_limit is a rate, such as {limit: 10, period: 1s}`},
		{"share_limit no limit", rule + fair + "    share_limit: {period: 1s}\n", `rules.yaml:9: rule "stripe": share_limit.limit: missing; share_limit is a rate`},
		{"share_limit zero", rule + fair + "    share_limit: {limit: 0, period: 1s}\n", `rules.yaml:9: rule "stripe": share_limit.limit: "0" must be a whole number from 1 to 1099511627776`},
		{"share_limit period zero", rule + fair + "    share_limit:\n      limit: 10\n      period: 0s\n", `rules.yaml:11: rule "stripe": share_limit.period: "0s" must be at least 1µs`},
		{"share_limit burst zero", rule + fair + "    share_limit: {limit: 10, period: 1s, burst: 0}\n", `rules.yaml:9: rule "stripe": share_limit.burst: "0" must be a whole number from 1 to`},
		{"priority empty", rule + "    priority: {}\n", `rules.yaml:8: rule "stripe": priority: give {payload_field: <JSON field>} or {queues: {critical: 2, default: 1}}, levels 0 to 9, and max_age if not 60 horizons; exactly one of payload_field and queues`},
		{"priority both", rule + "    priority: {payload_field: p, queues: {a: 1}}\n", `rules.yaml:8: rule "stripe": priority: give {payload_field`},
		{"priority scalar", rule + "    priority: high\n", `rules.yaml:8: rule "stripe": priority: priority must be a mapping with the fields payload_field, queues, max_age`},
		{"priority unknown field", rule + "    priority: {payload_field: p, levels: 3}\n", `rules.yaml:8: rule "stripe": priority: unknown field "levels"`},
		{"priority level 10", rule + "    priority:\n      queues: {critical: 10}\n", `rules.yaml:9: rule "stripe": priority.queues.critical: "10" must be a whole number from 0 to 9`},
		{"priority queues a list", rule + "    priority:\n      queues: [critical]\n", `rules.yaml:9: rule "stripe": priority.queues: a list must be a mapping of asynq queue to level (0 to 9)`},
		{"priority field empty", rule + "    priority: {payload_field: \"\"}\n", `rules.yaml:8: rule "stripe": priority.payload_field: must name a top-level field`},
		{"priority max_age zero", rule + "    priority:\n      payload_field: p\n      max_age: 0s\n", `rules.yaml:10: rule "stripe": priority.max_age: "0s" must be at least 1ms`},
		{"priority with share_limit", rule + fair + "    share_limit: {limit: 10, period: 1s}\n    priority: {payload_field: p}\n", `rules.yaml:10: rule "stripe": priority: cannot be combined with share_limit`},
		{"priority on concurrency", policy("      - {name: c, algorithm: concurrency, limit: 2, lease: 30s}\n") + "    priority: {payload_field: p}\n", `rules.yaml:7: rule "p": priority: cannot order a concurrency limit's queue`},
		{"share_limit unknown field", rule + fair + "    share_limit: {limit: 10, period: 1s, rate: 3}\n", `rules.yaml:9: rule "stripe": share_limit: unknown field "rate" in a share limit; allowed: limit, period, burst`},
		{"share_limit a number", rule + fair + "    share_limit: 10\n", `rules.yaml:9: rule "stripe": share_limit: a share limit must be a mapping with the fields limit, period, burst`},
		{"fair_by on concurrency", strings.Replace(edit("    period: 1s\n", ""), "algorithm: gcra", "algorithm: concurrency", 1) + fair, `rules.yaml:7: rule "stripe": fair_by: cannot share a concurrency limit: its queue for places is first come, first served`},
		{"fair_by in a policy with concurrency", policy("      - {name: rate, algorithm: gcra, limit: 100, period: 1s}\n      - {name: running, algorithm: concurrency, limit: 5}\n") + fair + "    share_limit: {limit: 10, period: 1s}\n", `rules.yaml:8: rule "p": fair_by: cannot share a concurrency limit`},
		{"cost over share burst", rule + fair + "    share_limit: {limit: 10, period: 1s, burst: 3}\n    cost: 5\n", `rules.yaml:10: rule "stripe": cost: 5 permits per task, but share_limit admits at most 3 at once; raise its burst or lower the cost`},
		{"cost over share limit", rule + fair + "    share_limit: {limit: 3, period: 1s}\n    cost: 5\n", `rules.yaml:10: rule "stripe": cost: 5 permits per task, but share_limit admits at most 3 at once`},

		// Policies.
		{"limits with algorithm", edit("    tasks:", "    limits: [{name: a, algorithm: gcra, limit: 1, period: 1s}]\n    tasks:"), `rules.yaml:6: rule "stripe": algorithm: cannot be combined with limits; set it in each of the limits`},
		{"limits empty", policy("      []\n"), `rules.yaml:6: rule "p": limits: a list must be a list of at least one limit`},
		{"limits mapping", "rules:\n  - name: p\n    tasks: [r]\n    subject: {fixed: x}\n    limits: {a: 1}\n", `rules.yaml:5: rule "p": limits: a mapping must be a list of at least one limit`},
		{"limit not a mapping", policy("      - per10s\n"), `rules.yaml:6: rule "p": limits[1]: a limit must be a mapping with the fields name, algorithm, limit, period, burst, precision`},
		{"limit unknown field", policy("      - {name: a, algorithm: gcra, limit: 1, period: 1s, max_wait: 1s}\n"), `rules.yaml:6: rule "p": limits[1]: unknown field "max_wait" in a limit; allowed: name, algorithm, limit, period, burst, precision`},
		{"limit own subject", policy("      - {name: a, algorithm: gcra, limit: 1, period: 1s, subject: {fixed: key-1}}\n"), `rules.yaml:6: rule "p": limits[1].subject: a limit cannot have a subject of its own in a rules file: tasks over several subjects could not park without polling. For each tenant's limit inside one API key's, make the key the rule's subject, the tenant its fair_by, and add share_limit`},
		{"limit no name", policy("      - {algorithm: gcra, limit: 1, period: 1s}\n"), `rules.yaml:6: rule "p": limits[1].name: missing; give each limit of a policy a name`},
		{"limit bad name", policy("      - {name: a.b, algorithm: gcra, limit: 1, period: 1s}\n"), `rules.yaml:6: rule "p": limits[1].name: "a.b": use letters, digits, '-' and '_' only, at most 64`},
		{"limit duplicate name", policy("      - {name: a, algorithm: gcra, limit: 1, period: 1s}\n      - {name: a, algorithm: gcra, limit: 2, period: 1s}\n"), `rules.yaml:7: rule "p": limits[2].name: "a" is also the name of the limit on line 6; names must be unique within a rule`},
		{"limit bad period", policy("      - {name: a, algorithm: gcra, limit: 1, period: 1s}\n      - name: b\n        algorithm: fixed_window\n        limit: 5\n        period: 0s\n"), `rules.yaml:10: rule "p": limits[2].period: "0s" must be at least 1µs`},
		{"limit missing limit", policy("      - {name: a, algorithm: gcra, period: 1s}\n"), `rules.yaml:6: rule "p": limits[1].limit: missing; how many tasks per period, such as 20`},
		{"concurrency period", policy("      - {name: a, algorithm: concurrency, limit: 3, period: 1s}\n"), `rules.yaml:6: rule "p": limits[1].period: does not apply to concurrency, which limits tasks running at once; give limit and lease`},
		{"concurrency short lease", policy("      - {name: a, algorithm: concurrency, limit: 3, lease: 10ms}\n"), `rules.yaml:6: rule "p": limits[1].lease: "10ms" must be at least 100ms`},
		{"concurrency twice", policy("      - {name: a, algorithm: concurrency, limit: 3}\n      - {name: b, algorithm: concurrency, limit: 5}\n"), `rules.yaml:6: rule "p": limits: a policy has at most one concurrency limit`},
		{"lease on a rate", policy("      - {name: a, algorithm: gcra, limit: 3, period: 1s, lease: 1s}\n"), `rules.yaml:6: rule "p": limits[1].lease: applies only to concurrency`},
		{"limit burst on window", policy("      - {name: a, algorithm: sliding_log, limit: 3, period: 1s, burst: 2}\n"), `rules.yaml:6: rule "p": limits[1].burst: applies only to token_bucket and gcra; sliding_log admits limit per period`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("rules.yaml", []byte(tc.yaml))
			if err == nil {
				t.Fatalf("ParseConfig succeeded: %+v", c)
			}
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("got %T %v, want a *Error", err, err)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("got  %s\nwant %s", err, tc.want)
			}
		})
	}
}

// TestConcurrencyConfig: a concurrency limit is limit places under a lease
// (30s by default), alone or beside rate limits in a policy.
func TestConcurrencyConfig(t *testing.T) {
	c, err := Parse("rules.yaml", []byte(`rules:
  - name: exports
    tasks: ["export:*"]
    subject: {fixed: all}
    algorithm: concurrency
    limit: 3
  - name: partner
    tasks: ["partner:*"]
    subject: {payload_field: account_id}
    cost: 50
    limits:
      - {name: rate, algorithm: gcra, limit: 100, period: 1s}
      - {name: running, algorithm: concurrency, limit: 5, lease: 10s}
`))
	if err != nil {
		t.Fatal(err)
	}
	want := []throttle.Rule{
		{Name: "exports", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 3, Period: DefaultLease, Burst: 3}},
		{Name: "partner.running", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 5, Period: 10 * time.Second, Burst: 5}},
	}
	if got := []throttle.Rule{c.Rules[0].Limits[0], c.Rules[1].Limits[1]}; !reflect.DeepEqual(got, want) {
		t.Errorf("got  %+v\nwant %+v", got, want)
	}
	for _, r := range c.Rules {
		if _, err := c.Limiter(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), r.Name, throttle.Options{}); err != nil {
			t.Errorf("Limiter(%s): %v", r.Name, err)
		}
	}
}

func TestSlidingLogLimit(t *testing.T) {
	y := strings.Replace(strings.Replace(rule, "algorithm: gcra", "algorithm: sliding_log", 1), "limit: 20", "limit: 2000000", 1)
	_, err := Parse("rules.yaml", []byte(y))
	want := `rules.yaml:6: rule "stripe": limit: 2000000 must be at most 1000000 for sliding_log, which stores every permit; use sliding_window`
	if err == nil || err.Error() != want {
		t.Errorf("got  %v\nwant %s", err, want)
	}
}

func TestConfigAnchors(t *testing.T) {
	y := `rules:
  - name: a
    tasks: [a]
    subject: &s {payload_field: tenant}
    algorithm: gcra
    limit: &l 10
    period: 1s
  - name: b
    tasks: [b]
    subject: *s
    algorithm: token_bucket
    limit: *l
    period: 1m
`
	c, err := Parse("rules.yaml", []byte(y))
	if err != nil {
		t.Fatal(err)
	}
	if c.Rules[1].Subject.PayloadField != "tenant" || c.Rules[1].Limits[0].Limit.Count != 10 {
		t.Errorf("aliases not followed: %+v", c.Rules[1])
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(validConfig))
	f.Add([]byte(rule))
	f.Add([]byte("rules: [{name: a, tasks: [a], subject: {fixed: x}, limits: [{name: b, algorithm: sliding_window, limit: 3, period: 1s, precision: 10ms}]}]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.yaml", data)
		if err != nil {
			var ce *Error
			if !errors.As(err, &ce) {
				t.Fatalf("error %T is not a *Error: %v", err, err)
			}
			if !strings.HasPrefix(err.Error(), "fuzz.yaml") {
				t.Fatalf("error does not name the file: %v", err)
			}
			return
		}
		// A config that parses is usable: every limit is valid.
		if len(c.Rules) == 0 {
			t.Fatal("a config without rules parsed")
		}
		for _, r := range c.Rules {
			if len(r.Limits) == 0 || len(r.Tasks) == 0 || (r.Subject.Fixed == "") == (r.Subject.PayloadField == "") {
				t.Fatalf("incomplete rule parsed: %+v", r)
			}
			for _, l := range r.Limits {
				if err := l.Validate(); err != nil {
					t.Fatalf("rule %q: invalid limit parsed: %v", r.Name, err)
				}
			}
		}
	})
}

// TestBudgets parses a budget shared by two rules, one drawing on it alone
// and one in a policy beside its own limit: both limiters charge the
// budget's one key, so their sum never exceeds it.
func TestBudgets(t *testing.T) {
	const file = `budgets:
  - {name: email, algorithm: fixed_window, limit: 10, period: 1m}
rules:
  - name: send
    tasks: ["email:send"]
    subject: {fixed: smtp}
    budget: email
  - name: digest
    tasks: ["email:digest"]
    subject: {fixed: smtp}
    limits:
      - {budget: email}
      - {name: own, algorithm: gcra, limit: 100, period: 1s}
`
	c, err := Parse("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	budget := throttle.Rule{Name: "email", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 10, Period: time.Minute, Burst: 10}}
	if got := c.Rules[0].Limits; len(got) != 1 || got[0] != budget {
		t.Errorf("send's limits %v, want the budget %v", got, budget)
	}
	if got := c.Rules[1].Limits; len(got) != 2 || got[0] != budget || got[1].Name != "digest.own" {
		t.Errorf("digest's limits %v, want the budget then digest.own", got)
	}
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		send, err := c.Limiter(rdb, "send", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		digest, err := c.Limiter(rdb, "digest", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		admitted := 0
		for i := range 30 {
			l := send
			if i%3 == 0 {
				l = digest
			}
			if res, err := l.Allow(ctx, "smtp"); err != nil {
				t.Fatal(err)
			} else if res.Allowed {
				admitted++
			}
		}
		if admitted != 10 {
			t.Errorf("send and digest together admitted %d in one minute, want the budget's 10", admitted)
		}
	})

	for _, tc := range []struct{ name, file, want string }{
		{"unknown budget", "rules:\n  - name: r\n    tasks: [t]\n    subject: {fixed: s}\n    budget: nope\n",
			`rules.yaml:5: rule "r": budget: "nope" is not a budget of this file; define it under budgets`},
		{"budget and limit", "budgets:\n  - {name: b, algorithm: gcra, limit: 1, period: 1s}\nrules:\n  - name: r\n    tasks: [t]\n    subject: {fixed: s}\n    budget: b\n    limit: 3\n",
			`rules.yaml:8: rule "r": limit: cannot be combined with budget; the budget defines the limit`},
		{"rule named as a budget", "budgets:\n  - {name: b, algorithm: gcra, limit: 1, period: 1s}\nrules:\n  - name: b\n    tasks: [t]\n    subject: {fixed: s}\n    budget: b\n",
			`rules.yaml:4: rule #1: name: "b" is also the name of a budget; a rule of that name would share the budget's keys, so rename one`},
		{"budget entry with more", "budgets:\n  - {name: b, algorithm: gcra, limit: 1, period: 1s}\nrules:\n  - name: r\n    tasks: [t]\n    subject: {fixed: s}\n    limits:\n      - {budget: b, limit: 3}\n",
			`rules.yaml:8: rule "r": limits[1]: a budget entry has only the field budget; the budget defines the limit`},
		{"budget without name", "budgets:\n  - {algorithm: gcra, limit: 1, period: 1s}\nrules: []\n",
			`rules.yaml:2: budgets[1].name: missing; give each budget a name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("rules.yaml", []byte(tc.file))
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("got  %v\nwant %s", err, tc.want)
			}
		})
	}
}

// TestOf derives subjects and costs from payloads as the workers and the
// producers both do.
func TestOf(t *testing.T) {
	payload := []byte(`{"tenant": "acme", "n": 3, "id": 42, "bad": true}`)
	for _, tc := range []struct {
		name    string
		s       SubjectConfig
		want    string
		wantErr string
	}{
		{"fixed", SubjectConfig{Fixed: "all"}, "all", ""},
		{"string field", SubjectConfig{PayloadField: "tenant"}, "acme", ""},
		{"number field", SubjectConfig{PayloadField: "id"}, "42", ""},
		{"missing", SubjectConfig{PayloadField: "nope"}, "", `payload has no field "nope"`},
		{"boolean", SubjectConfig{PayloadField: "bad"}, "", `payload field "bad" is a boolean; want a string or a number`},
	} {
		got, err := tc.s.Of(payload)
		if got != tc.want || (err == nil) != (tc.wantErr == "") || err != nil && err.Error() != tc.wantErr {
			t.Errorf("%s: Of = %q, %v; want %q, %q", tc.name, got, err, tc.want, tc.wantErr)
		}
	}
	for _, tc := range []struct {
		name    string
		c       CostConfig
		want    int
		wantErr string
	}{
		{"zero is one", CostConfig{}, 1, ""},
		{"permits", CostConfig{Permits: 5}, 5, ""},
		{"field", CostConfig{PayloadField: "n"}, 3, ""},
		{"not a number", CostConfig{PayloadField: "tenant"}, 0, `payload cost field "tenant" is a string; want a whole number of permits`},
		{"not an object", CostConfig{PayloadField: "n"}, 0, `payload is not a JSON object, so it has no cost field "n"`},
	} {
		p := payload
		if tc.name == "not an object" {
			p = []byte(`[1]`)
		}
		got, err := tc.c.Of(p)
		if got != tc.want || (err == nil) != (tc.wantErr == "") || err != nil && err.Error() != tc.wantErr {
			t.Errorf("%s: Of = %d, %v; want %d, %q", tc.name, got, err, tc.want, tc.wantErr)
		}
	}
}

// TestFairByConfig reads a rule's horizon, fair_by and weights.
func TestFairByConfig(t *testing.T) {
	cfg, err := Parse("rules.yaml", []byte(rule+"    horizon: 2s\n    fair_by: {payload_field: tenant}\n    weights: {gold: 3, silver: 2}\n"))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Rules[0]
	if r.Horizon != 2*time.Second || r.FairBy.PayloadField != "tenant" || r.Weights["gold"] != 3 || r.Weights["silver"] != 2 || len(r.Weights) != 2 {
		t.Errorf("rule: horizon %v, fair_by %+v, weights %v; want 2s, payload field tenant, gold 3 and silver 2", r.Horizon, r.FairBy, r.Weights)
	}
	share, err := r.FairBy.Of([]byte(`{"tenant": "acme"}`))
	if err != nil || share != "acme" {
		t.Errorf("share of a payload: %q, %v; want acme", share, err)
	}
}

// TestShareLimitConfig reads a rule's share_limit: limit per period, its
// burst the limit unless given, and a fixed cost up to that burst.
func TestShareLimitConfig(t *testing.T) {
	const fair = "    fair_by: {payload_field: tenant}\n"
	for _, tc := range []struct {
		name, body string
		want       throttle.Limit
	}{
		{"none", rule + fair, throttle.Limit{}},
		{"burst is the limit", rule + fair + "    share_limit: {limit: 10, period: 1s}\n", throttle.Limit{Count: 10, Period: time.Second, Burst: 10}},
		{"burst given", rule + fair + "    share_limit:\n      limit: 600\n      period: 1m\n      burst: 5\n", throttle.Limit{Count: 600, Period: time.Minute, Burst: 5}},
		{"cost at the burst", rule + fair + "    share_limit: {limit: 10, period: 1s, burst: 3}\n    cost: 3\n", throttle.Limit{Count: 10, Period: time.Second, Burst: 3}},
		{"burst over the limit", rule + fair + "    share_limit: {limit: 2, period: 1s, burst: 8}\n    cost: 8\n", throttle.Limit{Count: 2, Period: time.Second, Burst: 8}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("rules.yaml", []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			r := c.Rules[0]
			if r.ShareLimit != tc.want {
				t.Errorf("ShareLimit = %+v; want %+v", r.ShareLimit, tc.want)
			}
			// The share limit is the shares' own: the rule's limit stays.
			if want := (throttle.Limit{Count: 20, Period: time.Second, Burst: 20}); len(r.Limits) != 1 || r.Limits[0].Limit != want {
				t.Errorf("the rule's limits %+v; want one of %+v", r.Limits, want)
			}
		})
	}
}

// TestParsePriority reads a rule's priority from a payload field or from
// the task's queue, with its max_age, and PriorityConfig.Of gives each
// task its level: 0 where the payload or the queue says nothing.
func TestParsePriority(t *testing.T) {
	cfg, err := Parse("rules.yaml", []byte(`rules:
  - name: api
    tasks: ["api:*"]
    subject: {fixed: key}
    algorithm: gcra
    limit: 10
    period: 1s
    priority:
      queues: {critical: 9, default: 1}
      max_age: 30s
  - name: mail
    tasks: ["mail:*"]
    subject: {fixed: smtp}
    algorithm: gcra
    limit: 10
    period: 1s
    priority: {payload_field: prio}
`))
	if err != nil {
		t.Fatal(err)
	}
	api, mail := cfg.Rules[0], cfg.Rules[1]
	if api.MaxAge != 30*time.Second || mail.MaxAge != 0 {
		t.Errorf("max_age: api %v, mail %v; want 30s and 0 (the worker's default)", api.MaxAge, mail.MaxAge)
	}
	for _, tc := range []struct {
		c       PriorityConfig
		payload string
		queue   string
		want    int
		err     string
	}{
		{api.Priority, `{}`, "critical", 9, ""},
		{api.Priority, `{}`, "low", 0, ""},
		{mail.Priority, `{"prio": 3}`, "default", 3, ""},
		{mail.Priority, `{"x": 1}`, "default", 0, ""},
		{mail.Priority, `{"prio": 12}`, "default", 0, `payload priority field "prio" is 12; want a whole number from 0 to 9`},
		{mail.Priority, `{"prio": "high"}`, "default", 0, `is a string`},
		{mail.Priority, `[1]`, "default", 0, `not a JSON object`},
	} {
		got, err := tc.c.Of([]byte(tc.payload), tc.queue)
		if got != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("Of(%s, %s) = %d, %v; want %d, %q", tc.payload, tc.queue, got, err, tc.want, tc.err)
		}
	}
}

// TestLimitCosts reads a cost on each limit of a policy (an LLM call's
// requests, input and output tokens), a limit without one taking 1, and
// refuses what cannot work, at the line of the field.
func TestLimitCosts(t *testing.T) {
	head := "rules:\n  - name: llm\n    tasks: [llm:call]\n    subject: {fixed: openai}\n"
	good := head + "    limits:\n" +
		"      - {name: requests, algorithm: gcra, limit: 500, period: 1m}\n" +
		"      - {name: input, algorithm: gcra, limit: 30000, period: 1m, cost: {payload_field: input_tokens}}\n" +
		"      - {name: output, algorithm: gcra, limit: 10000, period: 1m, cost: {payload_field: max_tokens}}\n"
	cfg, err := Parse("rules.yaml", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.Rules[0]
	got, err := r.Costs([]byte(`{"input_tokens": 1200, "max_tokens": 300}`))
	if err != nil || !slices.Equal(got, throttle.Costs{1, 1200, 300}) {
		t.Fatalf("Costs: %v, %v; want [1 1200 300]", got, err)
	}
	if _, err := r.Costs([]byte(`{"input_tokens": 1200}`)); err == nil || !strings.Contains(err.Error(), `limit "llm.output"`) {
		t.Errorf("a missing field: %v; want an error naming the limit", err)
	}
	plain, err := Parse("rules.yaml", []byte(head+"    algorithm: gcra\n    limit: 1\n    period: 1s\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c, err := plain.Rules[0].Costs([]byte(`{}`)); c != nil || err != nil {
		t.Errorf("a rule without limit costs: %v, %v; want nil", c, err)
	}
	bad := []struct{ name, file, want string }{
		{"over capacity", head + "    limits:\n      - {name: a, algorithm: gcra, limit: 10, period: 1s, cost: 11}\n",
			`rules.yaml:6: rule "llm": limits[1].cost: 11 permits per task, but limit "llm.a" admits at most 10 at once`},
		{"empty field", head + "    limits:\n      - {name: a, algorithm: gcra, limit: 10, period: 1s, cost: {payload_field: \"\"}}\n",
			`limits[1].cost.payload_field: must name a top-level field`},
		{"with the rule's cost", head + "    cost: 2\n    limits:\n      - {name: a, algorithm: gcra, limit: 10, period: 1s, cost: 1}\n",
			`cost: cannot be combined with a cost on a limit`},
		{"with concurrency", head + "    limits:\n      - {name: a, algorithm: gcra, limit: 10, period: 1s, cost: 1}\n      - {name: c, algorithm: concurrency, limit: 2}\n",
			`costs on limits cannot be combined with concurrency limit "llm.c"`},
	}
	for _, c := range bad {
		_, err := Parse("rules.yaml", []byte(c.file))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want %q", c.name, err, c.want)
		}
	}
}

// TestCostEstimate reads a cost estimated from an LLM request body: the
// input from its messages (bytes / 4), the output from its max_tokens,
// the total both; Used picks the answer's count of the same kind.
func TestCostEstimate(t *testing.T) {
	head := "rules:\n  - name: llm\n    tasks: [llm:call]\n    subject: {fixed: openai}\n    limits:\n"
	cfg, err := Parse("rules.yaml", []byte(head+
		"      - {name: in, algorithm: gcra, limit: 30000, period: 1m, cost: {estimate: input_tokens}}\n"+
		"      - {name: out, algorithm: gcra, limit: 10000, period: 1m, cost: {estimate: output_tokens}}\n"+
		"      - {name: all, algorithm: gcra, limit: 90000, period: 1m, cost: {estimate: total_tokens}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	payload := []byte(`{"max_tokens": 300, "messages": [{"role": "user", "content": "hello there"}]}`) // messages: 44 bytes
	got, err := cfg.Rules[0].Costs(payload)
	if err != nil || !slices.Equal(got, throttle.Costs{11, 300, 311}) {
		t.Fatalf("Costs: %v, %v; want [11 300 311]", got, err)
	}
	for i, want := range []int{20, 7, 27} {
		if n, ok := cfg.Rules[0].LimitCost(i).Used(llmusage.Usage{Input: 20, Output: 7}); !ok || n != want {
			t.Errorf("limit %d: Used %d, %v; want %d", i, n, ok, want)
		}
	}
	if _, ok := (CostConfig{PayloadField: "n"}).Used(llmusage.Usage{Input: 1}); ok {
		t.Error("a payload field's cost: Used ok; want not an estimate")
	}
	for _, c := range []struct{ name, limit, want string }{
		{"unknown", "cost: {estimate: tokens}", `limits[1].cost.estimate: "tokens": use input_tokens`},
		{"both", "cost: {estimate: input_tokens, payload_field: n}", `limits[1].cost: give either payload_field or estimate`},
	} {
		_, err := Parse("rules.yaml", []byte(head+"      - {name: a, algorithm: gcra, limit: 10, period: 1s, "+c.limit+"}\n"))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want %q", c.name, err, c.want)
		}
	}
}
