package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

const calendarRules = `rules:
  - name: partner
    tasks: ["partner:*"]
    subject: {payload_field: account_id}
    limits:
      - {name: rate, algorithm: gcra, limit: 20, period: 1s}
      - {name: daily, algorithm: calendar, limit: 1000, period: day@America/Los_Angeles}
`

// --check and the status page say a calendar quota's window in its zone's
// wall time, and when it resets: at midnight in Los Angeles, 23 hours
// after the one before on the day daylight saving starts.
func TestCalendarWords(t *testing.T) {
	cfg, err := rules.Parse("rules.yaml", []byte(calendarRules))
	if err != nil {
		t.Fatal(err)
	}
	daily := cfg.Rules[0].Limits[1]
	if got, want := describeLimit(daily), "partner.daily: calendar, 1000 per day@America/Los_Angeles"; got != want {
		t.Errorf("describeLimit = %q; want %q", got, want)
	}
	la, _ := time.LoadLocation("America/Los_Angeles")
	now := time.Date(2025, 3, 9, 5, 0, 0, 0, la) // 04:00 PST + the hour skipped
	want := "partner.daily: this day runs from 2025-03-09 00:00 PST to 2025-03-10 00:00 PDT; it resets in 19h0m0s"
	if got := calendarWords(daily, now); got != want {
		t.Errorf("calendarWords = %q\nwant %q", got, want)
	}
	page := ruleOnPage(cfg.Rules[0], (*worker.Activity)(nil).Rule("partner"), nil, now)
	if !strings.Contains(strings.Join(page.Uses, "\n"), want) {
		t.Errorf("the status page's uses %q; want %q among them", page.Uses, want)
	}
	var b bytes.Buffer
	check(&b, cfg, &handler.Config{})
	if out := b.String(); !strings.Contains(out, "limit partner.daily: calendar, 1000 per day@America/Los_Angeles\n") ||
		!strings.Contains(out, "  partner.daily: this day runs from ") || !strings.Contains(out, "; it resets in ") ||
		!strings.Contains(out, "(on this machine's clock; one quota per subject, which a worker cannot list: no page or metric shows what remains)\n") {
		t.Errorf("--check printed:\n%s\nwant the calendar limit and its window", out)
	}
}
