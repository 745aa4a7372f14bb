package handler_test

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// An http handler limited by a rule exports the rate its upstream's
// headers taught the fleet, from memory: 0 before the first answer, the
// announced 2/s (at throttle.LearnedShare) after it, as
// jobthrottle_upstream_learned_rate{handler} and as the rule's
// Metrics.LearnedRate; a rule without such a handler reads 0.
func TestHTTPHandlerLearnedRateGauge(t *testing.T) {
	t.Parallel()
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("RateLimit-Policy", `"default";q=2;w=1`)
		fmt.Fprint(w, "ok")
	}))
	t.Cleanup(api.Close)
	file := fmt.Sprintf(`
rules:
  - {name: partner, tasks: ["partner:call"], subject: {fixed: partner}, algorithm: gcra, limit: 100, period: 1s}
  - {name: other, tasks: ["other:call"], subject: {fixed: x}, algorithm: gcra, limit: 1, period: 1s}
handlers:
  - {task: "partner:call", http: {url: %q}}
`, api.URL+"/v1")
	cfg, err := rules.Parse("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	hs, err := handler.ParseConfig("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := handler.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mux := asynq.NewServeMux()
	if err := hs.Register(mux, handler.Options{Rules: cfg, Redis: rdb, Metrics: m, Logger: slog.New(slog.DiscardHandler)}); err != nil {
		t.Fatal(err)
	}
	check := func(when string, want float64) {
		t.Helper()
		if got := learnedGauge(t, reg); len(got) != 1 || math.Abs(got["partner:call"]-want) > 1e-3 {
			t.Errorf("%s: jobthrottle_upstream_learned_rate %v; want only handler partner:call at %v", when, got, want)
		}
		if got, other := m.LearnedRate("partner"), m.LearnedRate("other"); other != 0 || math.Abs(got-want) > 1e-3 {
			t.Errorf("%s: Metrics.LearnedRate partner %v, other %v; want %v and 0", when, got, other, want)
		}
	}
	check("before any request", 0)
	if err := mux.ProcessTask(context.Background(), asynq.NewTask("partner:call", []byte(`{}`))); err != nil {
		t.Fatalf("ProcessTask: %v", err)
	}
	check("after the API announced 2/s", throttle.LearnedShare*2)
}

// learnedGauge returns jobthrottle_upstream_learned_rate by handler.
func learnedGauge(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "jobthrottle_upstream_learned_rate" {
			continue
		}
		for _, m := range mf.GetMetric() {
			got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	return got
}
