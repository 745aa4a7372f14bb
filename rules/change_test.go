package rules

import (
	"slices"
	"strings"
	"testing"
)

func mustParse(t *testing.T, body string) *Config {
	t.Helper()
	c, err := Parse("rules.yaml", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestDiff(t *testing.T) {
	old := mustParse(t, `rules:
  - {name: a, tasks: [a], subject: {fixed: s}, algorithm: gcra, limit: 2, period: 1s}
  - {name: b, tasks: [b], subject: {fixed: s}, algorithm: gcra, limit: 2, period: 1s}
  - {name: c, tasks: [c], subject: {fixed: s}, algorithm: gcra, limit: 2, period: 1s}
`)
	// a moves down a line (unchanged), b changes its limit, c goes, d comes.
	next := mustParse(t, `fail_open: true
rules:
  - {name: d, tasks: [d], subject: {fixed: s}, algorithm: gcra, limit: 2, period: 1s}
  - {name: b, tasks: [b], subject: {fixed: s}, algorithm: gcra, limit: 5, period: 1s}
  - {name: a, tasks: [a], subject: {fixed: s}, algorithm: gcra, limit: 2, period: 1s}
`)
	d := old.Diff(next)
	if !slices.Equal(d.Added, []string{"d"}) || !slices.Equal(d.Removed, []string{"c"}) || !slices.Equal(d.Changed, []string{"b"}) || !d.FailOpen {
		t.Errorf("Diff = %+v; want added [d], removed [c], changed [b], fail_open", d)
	}
	if d := old.Diff(old); d.Added != nil || d.Removed != nil || d.Changed != nil || d.FailOpen {
		t.Errorf("Diff with itself = %+v; want nothing", d)
	}
}

// TestDiffShareLimit: a rule whose share_limit alone changes (set, its
// numbers, dropped) is changed, and the change is accepted: the shares'
// states are a GCRA's under any numbers.
func TestDiffShareLimit(t *testing.T) {
	const base = "rules:\n  - {name: r, tasks: [r], subject: {fixed: s}, algorithm: gcra, limit: 100, period: 1s, fair_by: {payload_field: tenant}"
	without := mustParse(t, base+"}\n")
	with := mustParse(t, base+", share_limit: {limit: 10, period: 1s}}\n")
	for _, tc := range []struct {
		name      string
		old, next *Config
	}{
		{"set", without, with},
		{"burst", with, mustParse(t, base+", share_limit: {limit: 10, period: 1s, burst: 2}}\n")},
		{"period", with, mustParse(t, base+", share_limit: {limit: 10, period: 2s}}\n")},
		{"dropped", with, without},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if d := tc.old.Diff(tc.next); !slices.Equal(d.Changed, []string{"r"}) || d.Added != nil || d.Removed != nil {
				t.Errorf("Diff = %+v; want changed [r] only", d)
			}
			if err := tc.old.CheckChange(tc.next); err != nil {
				t.Errorf("CheckChange: %v; want accepted", err)
			}
		})
	}
	if d := with.Diff(mustParse(t, base+", share_limit: {limit: 10, period: 1s, burst: 10}}\n")); d.Changed != nil {
		t.Errorf("Diff with the default burst written out = %+v; want nothing", d)
	}
}

func TestCheckChange(t *testing.T) {
	rule := func(algo, limit, period string) string {
		return "rules:\n  - {name: r, tasks: [r], subject: {fixed: s}, limits: [{name: l, algorithm: " + algo + ", limit: " + limit + ", period: " + period + "}]}\n"
	}
	old := mustParse(t, rule("fixed_window", "2", "1s"))
	for _, tc := range []struct {
		name, next, want string // want "": accepted
	}{
		{"count", rule("fixed_window", "5", "1s"), ""},
		{"period", rule("fixed_window", "2", "1m"), `rules.yaml:2: rule "r": period: limit "r.l": 1m0s was 1s: a fixed window's state in Redis counts windows of its period; give the limit a new name`},
		{"algorithm", rule("sliding_window", "2", "1s"), `rules.yaml:2: rule "r": algorithm: limit "r.l": sliding_window was fixed_window`},
		{"renamed", strings.Replace(rule("sliding_log", "2", "1m"), "name: l", "name: l2", 1), ""},
		{"prefix", "prefix: \"x:\"\n" + rule("fixed_window", "2", "1s"), `rules.yaml: prefix: "x:" was "jobthrottle:"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := old.CheckChange(mustParse(t, tc.next))
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("CheckChange: %v; want %q", err, tc.want)
			}
		})
	}
	buckets := mustParse(t, rule("gcra", "2", "1s"))
	for _, next := range []string{rule("token_bucket", "2", "1s"), rule("gcra", "9", "1m")} {
		if err := buckets.CheckChange(mustParse(t, next)); err != nil {
			t.Errorf("gcra to %q: %v; want accepted (the same state)", next, err)
		}
	}
	conc := mustParse(t, "rules:\n  - {name: r, tasks: [r], subject: {fixed: s}, algorithm: concurrency, limit: 2, lease: 10s}\n")
	if err := conc.CheckChange(mustParse(t, "rules:\n  - {name: r, tasks: [r], subject: {fixed: s}, algorithm: concurrency, limit: 5, lease: 1m}\n")); err != nil {
		t.Errorf("concurrency limit and lease: %v; want accepted", err)
	}
}
