package enqueue

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const fullSchedules = `rules: rules.yaml
prefix: "jt:"
schedules:
  - name: nightly
    cron: "0 2 * * *"
    timezone: Europe/Berlin
    type: report:build
    count: 50
    payload: {"kind": "daily", "n": 1}
    queue: reports
    max_retry: 3
    timeout: 30s
    overlap: delay
    pace: {}
  - name: sync
    cron: "*/10 * * * * *"
    type: sync:account
    payloads: accounts.jsonl
    pace:
      rule: sync
      keep: 2h
      lead: 500ms
  - name: inline
    cron: "@every 5s"
    type: ping
    count: 3
    pace:
      rule: ping
      rate: 20/s
      burst: 2
      algorithm: token_bucket
      subject: {payload_field: tenant}
  - name: plain
    cron: "@hourly"
    type: cleanup
    count: 1
`

func TestParseSchedules(t *testing.T) {
	s, err := ParseSchedules("s.yaml", []byte(fullSchedules))
	if err != nil {
		t.Fatal(err)
	}
	if s.Rules != "rules.yaml" || s.Prefix != "jt:" || len(s.Schedules) != 4 {
		t.Fatalf("file: rules %q prefix %q, %d schedules", s.Rules, s.Prefix, len(s.Schedules))
	}
	n := s.Schedules[0]
	if n.Name != "nightly" || n.Cron != "0 2 * * *" || n.Timezone != "Europe/Berlin" || n.Type != "report:build" ||
		n.Count != 50 || string(n.Payload) != `{"kind":"daily","n":1}` || n.Queue != "reports" || n.MaxRetry != 3 ||
		n.Timeout != 30*time.Second || n.Overlap != OverlapDelay || n.Pace == nil || n.Pace.Rule != "" || n.Line != 4 {
		t.Errorf("nightly: %+v", n)
	}
	// 02:00 in Berlin is 01:00 UTC in winter.
	if got := n.Next(time.Date(2026, 1, 10, 12, 0, 0, 0, time.UTC)); !got.Equal(time.Date(2026, 1, 11, 1, 0, 0, 0, time.UTC)) {
		t.Errorf("nightly next = %v, want 2026-01-11 01:00 UTC", got)
	}
	sy := s.Schedules[1]
	if sy.Payloads != "accounts.jsonl" || sy.Count != 0 || sy.MaxRetry != -1 || sy.Overlap != OverlapSkip || sy.Pace.Rule != "sync" || sy.Pace.Keep != 2*time.Hour || sy.Pace.Lead != 500*time.Millisecond {
		t.Errorf("sync: %+v, pace %+v", sy, sy.Pace)
	}
	if got := sy.Next(time.Date(2026, 1, 1, 0, 0, 3, 0, time.UTC)); got.Second() != 10 {
		t.Errorf("six-field spec: next %v, want second 10", got)
	}
	in := s.Schedules[2].Pace
	want := throttle.Limit{Count: 20, Period: time.Second, Burst: 2}
	if in.Rule != "ping" || in.Limit != want || in.Algorithm != throttle.TokenBucket || in.Subject.PayloadField != "tenant" || in.Prefix != "jt:" {
		t.Errorf("inline pace: %+v", in)
	}
	if s.Schedules[3].Pace != nil {
		t.Error("plain: paced")
	}
}

// Every invalid file is refused with file:line: schedule "x": field: what
// is allowed.
func TestParseSchedulesInvalid(t *testing.T) {
	const head = "schedules:\n  - name: x\n    cron: \"@hourly\"\n    type: t\n"
	cases := []struct {
		name, file, want string
	}{
		{"empty", "", `f.yaml: the file is empty`},
		{"comment only", "# nothing\n", `f.yaml: the file is empty`},
		{"bad yaml", "schedules: [\n", `f.yaml:1: invalid YAML`},
		{"two documents", head + "    count: 1\n---\nschedules: []\n", `f.yaml:6: a second YAML document`},
		{"not a mapping", "- a\n", `f.yaml:1: the file must be a mapping`},
		{"unknown file field", "redis: x\n" + head + "    count: 1\n", `f.yaml:1: unknown field "redis" in the file; allowed: rules, prefix, schedules`},
		{"no schedules", "rules: r.yaml\n", `f.yaml:1: schedules: missing`},
		{"empty schedules", "schedules: []\n", `f.yaml:1: schedules: a list must be a list of at least one schedule`},
		{"prefix with brace", "prefix: \"a{b\"\n" + head + "    count: 1\n", `f.yaml:1: prefix: "a{b" must not contain '{' or '}'`},
		{"unknown field", head + "    count: 1\n    cunt: 2\n", `f.yaml:6: schedule "x": unknown field "cunt" in a schedule; allowed: name, cron,`},
		{"repeated field", head + "    count: 1\n    count: 2\n", `f.yaml:6: schedule "x": count: repeats the field set on line 5`},
		{"no name", "schedules:\n  - cron: \"@hourly\"\n", `f.yaml:2: schedule #1: name: missing`},
		{"bad name", "schedules:\n  - name: \"a b\"\n", `f.yaml:2: schedule #1: name: "a b": use letters, digits`},
		{"duplicate name", head + "    count: 1\n  - name: x\n", `f.yaml:6: schedule "x": name: "x" is also the name of the schedule on line 2`},
		{"no cron", "schedules:\n  - name: x\n    type: t\n", `f.yaml:2: schedule "x": cron: missing`},
		{"bad cron", "schedules:\n  - name: x\n    cron: \"61 * * * *\"\n", `f.yaml:3: schedule "x": cron: "61 * * * *": `},
		{"cron not a string", "schedules:\n  - name: x\n    cron: 5\n", `f.yaml:3: schedule "x": cron: "5" must be a string`},
		{"unknown zone", "schedules:\n  - name: x\n    timezone: Mars/Olympus\n    cron: \"@hourly\"\n", `f.yaml:3: schedule "x": timezone: "Mars/Olympus" is not a known time zone`},
		{"zone twice", "schedules:\n  - name: x\n    timezone: UTC\n    cron: \"CRON_TZ=UTC @hourly\"\n", `f.yaml:4: schedule "x": cron: "CRON_TZ=UTC @hourly" names a time zone and so does timezone`},
		{"no type", "schedules:\n  - name: x\n    cron: \"@hourly\"\n", `f.yaml:2: schedule "x": type: missing`},
		{"empty type", "schedules:\n  - name: x\n    cron: \"@hourly\"\n    type: \"\"\n", `f.yaml:4: schedule "x": type: is empty`},
		{"no count", head, `f.yaml:2: schedule "x": count: missing`},
		{"zero count", head + "    count: 0\n", `f.yaml:5: schedule "x": count: "0" must be a whole number from 1 to 10000000`},
		{"huge count", head + "    count: 99999999999\n", `f.yaml:5: schedule "x": count: "99999999999" must be a whole number from 1 to 10000000`},
		{"count string", head + "    count: ten\n", `f.yaml:5: schedule "x": count: "ten" must be a whole number`},
		{"payload and payloads", head + "    payload: {}\n    payloads: p.jsonl\n", `f.yaml:5: schedule "x": payload: cannot be combined with payloads`},
		{"payload not JSON", head + "    count: 1\n    payload: {1: x}\n", `f.yaml:6: schedule "x": payload: cannot be written as JSON`},
		{"empty payloads", head + "    payloads: \"\"\n", `f.yaml:5: schedule "x": payloads: is empty`},
		{"empty queue", head + "    count: 1\n    queue: \"\"\n", `f.yaml:6: schedule "x": queue: is empty`},
		{"negative max_retry", head + "    count: 1\n    max_retry: -1\n", `f.yaml:6: schedule "x": max_retry: "-1" must be a whole number from 0 to 1000`},
		{"timeout without unit", head + "    count: 1\n    timeout: 30\n", `f.yaml:6: schedule "x": timeout: "30" must be a duration with a unit`},
		{"timeout too short", head + "    count: 1\n    timeout: 10ms\n", `f.yaml:6: schedule "x": timeout: "10ms" must be at least 1s`},
		{"bad overlap", head + "    count: 1\n    overlap: queue\n", `f.yaml:6: schedule "x": overlap: "queue": use skip`},
		{"empty pace", head + "    count: 1\n    pace:\n", `f.yaml:6: schedule "x": pace: is empty`},
		{"pace without rules", head + "    count: 1\n    pace: {}\n", `f.yaml:6: schedule "x": pace: needs the workers' rules file`},
		{"pace unknown field", "rules: r.yaml\n" + head + "    count: 1\n    pace: {limit: 5}\n", `f.yaml:7: schedule "x": pace: unknown field "limit" in pace`},
		{"pace burst from rules", "rules: r.yaml\n" + head + "    count: 1\n    pace: {burst: 5}\n", `f.yaml:7: schedule "x": pace.burst: comes from the workers' rules file`},
		{"pace bad rule name", "rules: r.yaml\n" + head + "    count: 1\n    pace: {rule: \"a.b\"}\n", `f.yaml:7: schedule "x": pace.rule: "a.b": use the name`},
		{"inline without rule", head + "    count: 1\n    pace: {rate: 5/s}\n", `f.yaml:6: schedule "x": pace.rule: missing`},
		{"inline bad rate", head + "    count: 1\n    pace: {rule: r, rate: fast}\n", `f.yaml:6: schedule "x": pace.rate: rate "fast": write count/period`},
		{"inline zero rate", head + "    count: 1\n    pace: {rule: r, rate: 0/s}\n", `f.yaml:6: schedule "x": pace.rate: rate "0/s": the count "0" must be a whole number of at least 1`},
		{"inline unknown algorithm", head + "    count: 1\n    pace: {rule: r, rate: 5/s, algorithm: fixd_window}\n", `f.yaml:6: schedule "x": pace.algorithm: "fixd_window": use gcra (leaky_bucket), token_bucket`},
		{"inline no subject", head + "    count: 1\n    pace: {rule: r, rate: 5/s}\n", `f.yaml:6: schedule "x": pace.subject: missing`},
		{"inline two subjects", head + "    count: 1\n    pace: {rule: r, rate: 5/s, subject: {fixed: a, payload_field: b}}\n", `f.yaml:6: schedule "x": pace.subject: give {payload_field: <JSON field>} or {fixed: <subject>}, exactly one of them`},
		{"inline empty subject", head + "    count: 1\n    pace: {rule: r, rate: 5/s, subject: {fixed: \"\"}}\n", `f.yaml:6: schedule "x": pace.subject.fixed: "": throttle: invalid subject`},
		{"inline burst zero", head + "    count: 1\n    pace: {rule: r, rate: 5/s, burst: 0, subject: {fixed: a}}\n", `f.yaml:6: schedule "x": pace.burst: "0" must be a whole number from 1`},
		{"lead too long", "rules: r.yaml\n" + head + "    count: 1\n    pace: {lead: 2m}\n", `f.yaml:7: schedule "x": pace.lead: "2m" must be at most 1m0s`},
		{"keep too short", "rules: r.yaml\n" + head + "    count: 1\n    pace: {keep: 1ms}\n", `f.yaml:7: schedule "x": pace.keep: "1ms" must be at least 1s`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseSchedules("f.yaml", []byte(c.file))
			var se *rules.Error
			if !errors.As(err, &se) {
				t.Fatalf("err = %v, want a *rules.Error", err)
			}
			if !strings.HasPrefix(err.Error(), c.want) {
				t.Errorf("err = %q\nwant prefix %q", err, c.want)
			}
		})
	}
}

func TestLoadSchedules(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("rules.yaml", `rules:
  - name: sync
    tasks: ["sync:*"]
    subject: {payload_field: account}
    algorithm: gcra
    limit: 10
    period: 1s
  - name: report
    tasks: ["report:build"]
    subject: {fixed: all}
    algorithm: sliding_window
    limit: 10
    period: 1m
`)
	write("accounts.jsonl", "{\"account\": \"a\"}\n\n{\"account\": \"b\"}\n")
	ok := write("ok.yaml", "rules: rules.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: sync:account\n    payloads: accounts.jsonl\n    pace: {}\n")
	s, err := LoadSchedules(ok)
	if err != nil {
		t.Fatal(err)
	}
	sc := s.Schedules[0]
	if s.RulesConfig == nil || len(sc.loaded.Payloads) != 2 || string(sc.loaded.Payloads[1]) != `{"account": "b"}` || sc.loaded.Lines[1] != 3 || sc.Pace.Rules != s.RulesConfig {
		t.Errorf("loaded: rules %v, payloads %q at lines %v", s.RulesConfig != nil, sc.loaded.Payloads, sc.loaded.Lines)
	}

	cases := []struct {
		name, file, want string
	}{
		{"no rules file", "rules: nope.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: t\n    count: 1\n",
			"enqueue: %s: rules: rules: reading rules file"},
		{"no rule for the type", "rules: rules.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: other\n    count: 1\n    pace: {}\n",
			`%s:3: schedule "s": pace: ` + "%s" + `: no rule applies to tasks of type "other"`},
		{"other rule", "rules: rules.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: sync:x\n    count: 1\n    pace: {rule: report}\n",
			`%s:3: schedule "s": pace: ` + "%s" + `: the workers apply rule "sync" to tasks of type "sync:x", not "report"`},
		{"missing payloads", "schedules:\n  - name: s\n    cron: \"@hourly\"\n    type: t\n    payloads: nope.jsonl\n",
			`%s:2: schedule "s": payloads: open `},
		{"bad payload line", "schedules:\n  - name: s\n    cron: \"@hourly\"\n    type: t\n    payloads: bad.jsonl\n",
			`%s:2: schedule "s": payloads: ` + "%s" + `:2: not a JSON value`},
		{"payload without the subject", "rules: rules.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: sync:x\n    payloads: nosubject.jsonl\n    pace: {}\n",
			`%s:3: schedule "s": payloads: ` + "%s" + `:4: subject: payload has no field "account"; a paced task needs the subject (and cost) the workers' rule reads`},
		{"payload without the cost", "rules: costs.yaml\nschedules:\n  - name: s\n    cron: \"@hourly\"\n    type: sync:x\n    count: 2\n    payload: {account: a, n: x}\n    pace: {}\n",
			`%s:3: schedule "s": payload: cost: payload cost field "n" is a string`},
		{"count above payloads", "schedules:\n  - name: s\n    cron: \"@hourly\"\n    type: t\n    count: 3\n    payloads: accounts.jsonl\n",
			`%s:2: schedule "s": count: 3 is more than the 2 payloads in accounts.jsonl`},
	}
	write("bad.jsonl", "{}\n{nope\n")
	write("nosubject.jsonl", "{\"account\": \"a\"}\n{\"account\": \"b\"}\n\n{\"other\": 1}\n")
	write("costs.yaml", "rules:\n  - {name: sync, tasks: [\"sync:*\"], subject: {payload_field: account}, cost: {payload_field: n}, algorithm: gcra, limit: 10, period: 1s}\n")
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := write("case.yaml", c.file)
			_, err := LoadSchedules(p)
			if err == nil {
				t.Fatal("loaded")
			}
			other := filepath.Join(dir, "rules.yaml")
			if strings.Contains(c.want, "payloads: %s") {
				other = filepath.Join(dir, "bad.jsonl")
				if strings.Contains(c.name, "subject") {
					other = filepath.Join(dir, "nosubject.jsonl")
				}
			}
			want := c.want
			if strings.Count(want, "%s") == 2 {
				want = strings.Replace(strings.Replace(want, "%s", p, 1), "%s", other, 1)
			} else {
				want = strings.Replace(want, "%s", p, 1)
			}
			if !strings.HasPrefix(err.Error(), want) {
				t.Errorf("err = %q\nwant prefix %q", err, want)
			}
		})
	}
}

func TestParseRate(t *testing.T) {
	cases := []struct {
		in   string
		want throttle.Limit
		ok   bool
	}{
		{"20/s", throttle.Limit{Count: 20, Period: time.Second, Burst: 1}, true},
		{" 100 / m ", throttle.Limit{Count: 100, Period: time.Minute, Burst: 1}, true},
		{"5000/h", throttle.Limit{Count: 5000, Period: time.Hour, Burst: 1}, true},
		{"20000/d", throttle.Limit{Count: 20000, Period: 24 * time.Hour, Burst: 1}, true},
		{"3/500ms", throttle.Limit{Count: 3, Period: 500 * time.Millisecond, Burst: 1}, true},
		{"1/second", throttle.Limit{Count: 1, Period: time.Second, Burst: 1}, true},
		{"20", throttle.Limit{}, false},
		{"0/s", throttle.Limit{}, false},
		{"-1/s", throttle.Limit{}, false},
		{"1.5/s", throttle.Limit{}, false},
		{"1/fortnight", throttle.Limit{}, false},
		{"1/0s", throttle.Limit{}, false},
		{"1/-1s", throttle.Limit{}, false},
		{"1/99999h", throttle.Limit{}, false},
	}
	for _, c := range cases {
		got, err := ParseRate(c.in, 1)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("ParseRate(%q) = %v, %v; want %v, ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

// ParseRate's errors say what is wrong with the value, in the terms of
// a rate: a count too large gives the maximum; a bad burst says what a
// burst is, without naming library functions. FormatRate writes back
// what ParseRate reads.
func TestParseRateMessages(t *testing.T) {
	for _, c := range []struct {
		in    string
		burst int
		want  string
	}{
		{"99999999999999999999999/s", 1, `rate "99999999999999999999999/s": the count "99999999999999999999999" is too large: at most 1099511627776`},
		{"2000000000000/s", 1, `the count "2000000000000" is too large: at most 1099511627776`},
		{"-99999999999999999999999/s", 1, `must be a whole number of at least 1`},
		{"5/s", -1, `rate "5/s": the burst -1 must be at least 1: the most permits admitted at one instant`},
	} {
		_, err := ParseRate(c.in, c.burst)
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "PerSecond") {
			t.Errorf("ParseRate(%q, %d) = %v, want %q", c.in, c.burst, err, c.want)
		}
	}
	for _, in := range []string{"20/s", "100/m", "5000/h", "20000/d", "3/500ms", "7/1m30s"} {
		l, err := ParseRate(in, 1)
		if err != nil || FormatRate(l) != in {
			t.Errorf("FormatRate(ParseRate(%q)) = %q, %v", in, FormatRate(l), err)
		}
	}
}

// FuzzParseSchedules checks that no input panics the parser, that every
// refusal is a *rules.Error with a line inside the file, and that every
// accepted file has schedules that can run.
func FuzzParseSchedules(f *testing.F) {
	f.Add([]byte(fullSchedules))
	f.Add([]byte("schedules:\n  - name: x\n    cron: \"@every 1s\"\n    type: t\n    count: 1\n"))
	f.Add([]byte("schedules:\n  - &a {name: x, cron: \"* * * * *\", type: t, count: 1}\n  - *a\n"))
	f.Add([]byte("schedules:\n  - name: x\n    cron: \"TZ=UTC 0 0 30 2 *\"\n    type: t\n    count: 1\n"))
	f.Add([]byte("rules: r\nschedules:\n  - {name: x, cron: \"@daily\", type: t, count: 2, pace: {rule: a, rate: 3/2s, subject: {fixed: s}}}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseSchedules("f.yaml", data)
		if err != nil {
			var se *rules.Error
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *rules.Error", err)
			}
			if lines := yamlLines(data); se.Line < 0 || se.Line > lines {
				t.Fatalf("error on line %d of a %d-line file: %v", se.Line, lines, err)
			}
			return
		}
		if len(s.Schedules) == 0 {
			t.Fatal("accepted a file without schedules")
		}
		for _, sc := range s.Schedules {
			if sc.schedule == nil || sc.Name == "" || sc.Type == "" || (sc.Count == 0 && sc.Payloads == "") {
				t.Fatalf("accepted an incomplete schedule %+v", sc)
			}
			if p := sc.Pace; p != nil && p.Limit.Count > 0 {
				if err := (throttle.Rule{Name: p.Rule, Algorithm: p.Algorithm, Limit: p.Limit}).Validate(); err != nil {
					t.Fatalf("accepted an invalid inline rule: %v", err)
				}
				if (p.Subject == rules.SubjectConfig{}) {
					t.Fatal("accepted an inline rule without subject")
				}
			}
		}
	})
}

// yamlLines counts lines as YAML does: \r\n, \r and \n end a line (and,
// leniently, the Unicode line breaks YAML 1.1 knows).
func yamlLines(data []byte) int {
	s := strings.NewReplacer("\r\n", "\n", "\r", "\n", "\u0085", "\n", "\u2028", "\n", "\u2029", "\n").Replace(string(data))
	return strings.Count(s, "\n") + 1
}
