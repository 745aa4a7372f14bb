package main

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// quotaRulesFile has a quota of a fixed subject, 10 a day in Los Angeles
// beside 5/s, and one per account (a payload field), 100 a month.
const quotaRulesFile = `rules:
  - name: partner
    tasks: ["partner:*"]
    subject: {fixed: all}
    limits:
      - {name: rate,  algorithm: gcra,     limit: 5,  period: 1s, burst: 5}
      - {name: daily, algorithm: calendar, limit: 10, period: day@America/Los_Angeles}
  - {name: tenant, tasks: ["tenant:*"], subject: {payload_field: account_id}, algorithm: calendar, limit: 100, period: month@UTC}
`

// The status page says what remains of a quota of a fixed subject after
// tasks were charged, and until when, in its zone's wall time, from one
// read that later pages within quotaPageAge reuse; a quota per account
// says why it shows no number.
func TestStatusPageQuotas(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		cfg, hs := parseBoth(t, `prefix: "`+redistest.Prefix(t)+`"
`+quotaRulesFile)
		policy, err := cfg.Limiter(rdb, "partner", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer policy.Close()
		for range 3 {
			if res, err := policy.Allow(context.Background(), "all"); err != nil || !res.Allowed {
				t.Fatalf("a task of partner: %+v, %v; want it allowed", res, err)
			}
		}
		quotas, err := worker.NewQuotaCollector(rdb, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer quotas.Close()
		st := newStatus(cfg, hs, nil, nil)
		st.quotas = quotas
		// The clock starts at 2000-01-01 00:00 UTC: 16:00 in Los Angeles.
		time.Sleep(time.Hour)
		daily := func(resets, ago string) string {
			return "partner.daily: this day runs from 1999-12-31 00:00 PST to 2000-01-01 00:00 PST; it resets in " + resets +
				" (this machine&#39;s clock); remaining 7 of 10 until 2000-01-01 00:00 PST (read from Redis " + ago + " ago)"
		}
		tenant := func(resets string) string {
			return "tenant: this month runs from 2000-01-01 00:00 UTC to 2000-02-01 00:00 UTC; it resets in " + resets +
				" (this machine&#39;s clock); what remains is kept per subject (payload field &#34;account_id&#34;), one quota each, which a worker cannot list: not shown"
		}
		for i, want := range [][2]string{{daily("7h0m0s", "0s"), tenant("743h0m0s")}, {daily("6h59m55s", "5s"), tenant("742h59m55s")}} {
			if i > 0 {
				m.SetError("the page must not ask Redis again within quotaPageAge")
				time.Sleep(quotaPageAge / 2)
			}
			body := get(st, http.MethodGet, "/status").Body.String()
			for _, w := range want {
				if !strings.Contains(body, w) {
					t.Errorf("page %d lacks %q:\n%s", i+1, w, uses(body))
				}
			}
			if strings.Contains(body, "could not be read") {
				t.Errorf("page %d read Redis again within quotaPageAge:\n%s", i+1, uses(body))
			}
		}
		time.Sleep(quotaPageAge)
		body := get(st, http.MethodGet, "/status").Body.String()
		if want := "remaining 7 of 10 until 2000-01-01 00:00 PST (read from Redis 15s ago); what remains could not be read from Redis now: "; !strings.Contains(body, want) {
			t.Errorf("with Redis failing, the page lacks %q:\n%s", want, uses(body))
		}
	})
}

// uses is the lines of the page's lists of limits' uses, for messages.
func uses(body string) string {
	var out []string
	for _, l := range strings.Split(body, "<li>") {
		if strings.Contains(l, "this machine") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
