package worker

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// quotaRules has a policy of a fixed subject, 5/s and 10 a day in Los
// Angeles, and a quota per account (a payload field), 100 a month.
func quotaRules(prefix string) string {
	return `prefix: "` + prefix + `"
rules:
  - name: partner
    tasks: ["partner:*"]
    subject: {fixed: all}
    limits:
      - {name: rate,  algorithm: gcra,     limit: 5,  period: 1s, burst: 5}
      - {name: daily, algorithm: calendar, limit: 10, period: day@America/Los_Angeles}
  - {name: tenant, tasks: ["tenant:*"], subject: {payload_field: account_id}, algorithm: calendar, limit: 100, period: month@UTC}
`
}

// quotaCollector returns a collector of cfg's quotas on rdb, closed when
// the test ends, and a registry of it alone.
func quotaCollector(t *testing.T, rdb redis.UniversalClient, cfg *rules.Config) (*QuotaCollector, *prometheus.Registry) {
	t.Helper()
	c, err := NewQuotaCollector(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	return c, reg
}

// A scrape reads what remains of each calendar quota of a fixed subject,
// alone (not the tightest of its policy: the 5/s limit has 2 left) and
// without charging it, and how long until its window ends on the Redis
// clock: at midnight in Los Angeles. The quota per account has no metric;
// Quotas gives it unread, with its payload field.
func TestQuotaCollectorReadsEachQuotaAlone(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		cfg := parseRules(t, quotaRules(redistest.Prefix(t)))
		mw, err := FromRules(cfg, rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		if ran, deferred := tally(t, mw, "partner:call", 3, nil); ran != 3 || deferred != 0 {
			t.Fatalf("%d ran, %d deferred; want 3, 0", ran, deferred)
		}
		policy, err := cfg.Limiter(rdb, "partner", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer policy.Close()
		if res, err := policy.AllowN(context.Background(), "all", 0); err != nil || res.Remaining != 2 {
			t.Fatalf("the policy's read: %+v, %v; want 2 remaining, of its 5/s", res, err)
		}
		c, reg := quotaCollector(t, rdb, cfg)
		// The clock starts at 2000-01-01 00:00 UTC: 16:00 in Los Angeles,
		// 8 hours before its midnight.
		for i, reset := range []time.Duration{8 * time.Hour, 7 * time.Hour} {
			if i > 0 {
				time.Sleep(time.Hour)
			}
			got := scrape(t, reg)
			if n, want := got["jobthrottle_quota_remaining"], map[string]float64{"limit=partner.daily,rule=partner": 7}; !sameSamples(n, want) {
				t.Errorf("scrape %d: remaining %v; want %v", i+1, n, want)
			}
			if s, want := got["jobthrottle_quota_reset_seconds"], map[string]float64{"limit=partner.daily,rule=partner": reset.Seconds()}; !sameSamples(s, want) {
				t.Errorf("scrape %d: reset seconds %v; want %v", i+1, s, want)
			}
			if n := got["jobthrottle_quota_read_errors_total"][""]; n != 0 {
				t.Errorf("scrape %d: read errors %v; want 0", i+1, n)
			}
		}
		qs, err := c.Quotas(time.Minute) // the last scrape's read
		if err != nil {
			t.Fatal(err)
		}
		la, _ := time.LoadLocation("America/Los_Angeles")
		if len(qs) != 2 {
			t.Fatalf("Quotas = %+v; want partner.daily and tenant", qs)
		}
		if q := qs[0]; q.Limit != "partner.daily" || !q.Read || q.Remaining != 7 || q.Count != 10 || !q.Resets().Equal(time.Date(2000, 1, 1, 0, 0, 0, 0, la)) {
			t.Errorf("partner.daily: %+v, resets %v; want 7 of 10 read, resetting at 2000-01-01 00:00 PST", q, q.Resets())
		}
		if q := qs[1]; q.Limit != "tenant" || q.Read || q.PayloadField != "account_id" {
			t.Errorf("tenant: %+v; want unread, per payload field account_id", q)
		}
	})
}

// sameSamples reports whether a scrape's samples of one metric are want.
func sameSamples(got, want map[string]float64) bool {
	if len(got) != len(want) {
		return false
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			return false
		}
	}
	return true
}

// A failed read counts an error and leaves the quota metrics out; Quotas
// then gives the quotas as last read (unread before any), with the error;
// a read within maxAge of the last one reuses it.
func TestQuotaCollectorReadErrors(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		cfg := parseRules(t, quotaRules(redistest.Prefix(t)))
		c, reg := quotaCollector(t, rdb, cfg)
		m.SetError("ERR injected: the server refuses every command")
		if qs, err := c.Quotas(0); err == nil || len(qs) != 2 || qs[0].Read {
			t.Errorf("Quotas on a failing Redis, never read = %+v, %v; want both unread, and an error", qs, err)
		}
		m.SetError("")
		if got := scrape(t, reg)["jobthrottle_quota_remaining"]; got["limit=partner.daily,rule=partner"] != 10 {
			t.Fatalf("remaining %v; want 10 for partner.daily", got)
		}
		m.SetError("ERR injected: the server refuses every command")
		got := scrape(t, reg)
		if n := got["jobthrottle_quota_read_errors_total"][""]; n != 1 {
			t.Errorf("read errors %v; want 1", n)
		}
		if len(got["jobthrottle_quota_remaining"]) != 0 || len(got["jobthrottle_quota_reset_seconds"]) != 0 {
			t.Errorf("quota samples from a failed read: %v", got)
		}
		time.Sleep(time.Second)
		if qs, err := c.Quotas(0); err == nil || len(qs) != 2 || !qs[0].Read || qs[0].Remaining != 10 || time.Since(qs[0].At) != time.Second {
			t.Errorf("Quotas on a failing Redis = %+v, %v; want the read of a second ago, and an error", qs, err)
		}
		m.SetError("")
		if qs, err := c.Quotas(0); err != nil || !qs[0].Read || qs[0].Remaining != 10 || !qs[0].At.Equal(time.Now()) {
			t.Fatalf("Quotas = %+v, %v; want partner.daily read now, 10 left", qs, err)
		}
		m.SetError("ERR injected: the server refuses every command")
		time.Sleep(time.Second)
		if qs, err := c.Quotas(time.Minute); err != nil || !qs[0].Read {
			t.Errorf("Quotas within a minute of the last read = %+v, %v; want that read, without asking Redis", qs, err)
		}
	})
}

// A Redis that does not answer holds a read up for QuotaReadTimeout at
// most, on the test's virtual clock: the scrape has no quota metrics and
// counts an error, and one while that read is still under way counts an
// error at once instead of starting another.
func TestQuotaCollectorTimeout(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, _ *redis.Client, _ *miniredis.Miniredis) {
		var mu sync.Mutex
		var silent []net.Conn // the server's ends, never answered
		defer func() {
			mu.Lock()
			defer mu.Unlock()
			for _, c := range silent {
				c.Close()
			}
		}()
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:0", Protocol: 2, DisableIdentity: true, PoolSize: redistest.BubblePoolSize,
			ReadTimeout: time.Minute, WriteTimeout: time.Minute, MaxRetries: -1,
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				client, server := net.Pipe()
				go func() { // read the commands, never answer
					buf := make([]byte, 4096)
					for {
						if _, err := server.Read(buf); err != nil {
							return
						}
					}
				}()
				mu.Lock()
				silent = append(silent, server)
				mu.Unlock()
				return client, nil
			}})
		defer rdb.Close()
		_, reg := quotaCollector(t, rdb, parseRules(t, quotaRules("q:")))
		for i, took := range []time.Duration{QuotaReadTimeout, 0} {
			start := time.Now()
			got := scrape(t, reg)
			if d := time.Since(start); d != took {
				t.Errorf("scrape %d took %v; want %v", i+1, d, took)
			}
			if len(got["jobthrottle_quota_remaining"]) != 0 {
				t.Errorf("scrape %d: quota samples %v from a Redis that does not answer", i+1, got["jobthrottle_quota_remaining"])
			}
			if n := got["jobthrottle_quota_read_errors_total"][""]; n != float64(i+1) {
				t.Errorf("after scrape %d: read errors = %v, want %d", i+1, n, i+1)
			}
		}
		time.Sleep(2 * time.Minute) // the stuck read ends at go-redis's own timeout
	})
}
