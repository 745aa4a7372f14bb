package rules

import (
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestCalendarConfig: a quota on the calendar is a limit per day, week or
// month in a named zone, alone or beside per-second limits in a policy.
func TestCalendarConfig(t *testing.T) {
	c, err := Parse("rules.yaml", []byte(`rules:
  - name: partner
    tasks: ["partner:*"]
    subject: {payload_field: account_id}
    limits:
      - {name: rate, algorithm: gcra, limit: 20, period: 1s}
      - {name: daily, algorithm: calendar, limit: 1000, period: day@America/Los_Angeles}
  - name: reports
    tasks: ["report:*"]
    subject: {fixed: all}
    algorithm: calendar
    limit: 50000
    period: week(sunday)@UTC
`))
	if err != nil {
		t.Fatal(err)
	}
	daily, weekly := c.Rules[0].Limits[1], c.Rules[1].Limits[0]
	if daily.Algorithm != throttle.CalendarWindow || daily.Limit.Count != 1000 || daily.Calendar.String() != "day@America/Los_Angeles" {
		t.Errorf("daily: %+v", daily)
	}
	if weekly.Limit.Count != 50000 || weekly.Calendar.Unit() != "week" || weekly.Calendar.WeekStart() != time.Sunday {
		t.Errorf("weekly: %+v", weekly)
	}
	for _, r := range c.Rules {
		if _, err := c.Limiter(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), r.Name, throttle.Options{}); err != nil {
			t.Errorf("Limiter(%s): %v", r.Name, err)
		}
	}
}

// A calendar limit's mistakes are reported at their line, saying what to
// write instead.
func TestCalendarConfigErrors(t *testing.T) {
	const head = "rules:\n  - name: q\n    tasks: [r]\n    subject: {fixed: x}\n"
	for _, tc := range []struct{ name, yaml, want string }{
		{"unknown zone", head + "    algorithm: calendar\n    limit: 5\n    period: day@America/Springfield\n",
			`rules.yaml:7: rule "q": period: calendar "day@America/Springfield": unknown time zone "America/Springfield"; use an IANA name such as UTC, Europe/Berlin or America/Los_Angeles`},
		{"bad unit", head + "    algorithm: calendar\n    limit: 5\n    period: fortnight@UTC\n",
			`rules.yaml:7: rule "q": period: calendar "fortnight@UTC": unknown unit "fortnight"; use day, week, week(sunday) or month`},
		{"no zone", head + "    algorithm: calendar\n    limit: 5\n    period: day\n",
			`rules.yaml:7: rule "q": period: calendar "day" names no time zone; write day@UTC, week@Europe/Berlin or month@America/Los_Angeles`},
		{"a duration", head + "    algorithm: calendar\n    limit: 5\n    period: 24h\n",
			`rules.yaml:7: rule "q": period: calendar "24h" names no time zone; write day@UTC, week@Europe/Berlin or month@America/Los_Angeles`},
		{"no period", head + "    algorithm: calendar\n    limit: 5\n",
			`rules.yaml:2: rule "q": period: missing; a calendar such as day@UTC, week@Europe/Berlin or month@America/Los_Angeles`},
		{"a burst", head + "    algorithm: calendar\n    limit: 5\n    period: day@UTC\n    burst: 2\n",
			`rules.yaml:8: rule "q": burst: does not apply to calendar, which admits limit per calendar period`},
		{"a calendar on gcra", head + "    algorithm: gcra\n    limit: 5\n    period: day@UTC\n",
			`rules.yaml:7: rule "q": period: "day@UTC" is a calendar; a quota on the calendar needs algorithm calendar`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("rules.yaml", []byte(tc.yaml))
			if err == nil || err.Error() != tc.want {
				t.Errorf("got  %v\nwant %s", err, tc.want)
			}
		})
	}
	if !strings.Contains(AlgorithmNames(PaceAlgorithms()), "sliding_window") || strings.Contains(AlgorithmNames(PaceAlgorithms()), "calendar") {
		t.Errorf("PaceAlgorithms() = %v: a producer's inline rate cannot be a calendar quota", PaceAlgorithms())
	}
}

// A reloaded file with the same calendar quota changes nothing; a quota
// moved to another zone or unit is refused (its count would restart), and
// one renamed is accepted.
func TestCalendarChange(t *testing.T) {
	file := func(name, period string) *Config {
		c, err := Parse("rules.yaml", []byte("rules:\n  - {name: r, tasks: [r], subject: {fixed: s}, limits: [{name: "+name+", algorithm: calendar, limit: 5, period: "+period+"}]}\n"))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	old := file("q", "day@America/Los_Angeles")
	if d := old.Diff(file("q", "day@America/Los_Angeles")); d.Changed != nil {
		t.Errorf("Diff of the same file = %+v; want nothing", d)
	}
	for _, tc := range []struct{ name, period, want string }{
		{"zone", "day@UTC", `period: limit "r.q": day@UTC was day@America/Los_Angeles: a calendar quota's count in Redis is of the old calendar's window`},
		{"unit", "month@America/Los_Angeles", `period: limit "r.q": month@America/Los_Angeles was day@America/Los_Angeles`},
	} {
		if err := old.CheckChange(file("q", tc.period)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: CheckChange = %v; want %q", tc.name, err, tc.want)
		}
	}
	if err := old.CheckChange(file("q2", "day@UTC")); err != nil {
		t.Errorf("renamed: CheckChange = %v; want accepted", err)
	}
}
