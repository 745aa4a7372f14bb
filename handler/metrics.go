package handler

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the handlers' Prometheus metrics. Their labels are the
// handler's task type as the rules file names it, its kind and the
// outcome: never a subject, a task ID nor anything from a payload.
//
//	jobthrottle_handler_attempts_total{handler,kind,outcome}  attempts by outcome (see the Outcome constants)
//	jobthrottle_handler_duration_seconds{handler,kind}        histogram of the time an attempt took, whatever its outcome
//	jobthrottle_upstream_learned_rate{handler}                 requests/s learned for an http handler's upstream (limited by a rule), 0 if none
//
// kind is "http" or "command". A nil *Metrics records nothing. Pass one
// to Register with Options.Metrics; one Metrics serves every Register of
// a process (a reload registers the handlers again).
type Metrics struct {
	attempts *prometheus.CounterVec
	duration *prometheus.HistogramVec
	learned  *learnedRates
}

// NewMetrics creates the handlers' metrics and registers them on reg. It
// returns an error if reg is nil or already has metrics of these names.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("handler: NewMetrics: nil prometheus.Registerer; pass prometheus.DefaultRegisterer or a prometheus.NewRegistry()")
	}
	m := &Metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "handler_attempts_total",
			Help:      "Attempts of the rules file's handlers, by handler (its task type), kind (http, command) and outcome: success, http_4xx, http_5xx, throttled (deferred, not failed), timeout, exit_nonzero, signal, canceled, error.",
		}, []string{"handler", "kind", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "jobthrottle",
			Name:      "handler_duration_seconds",
			Help:      "Time an attempt of a rules file's handler took, whatever its outcome, by handler (its task type) and kind (http, command).",
			Buckets:   []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900},
		}, []string{"handler", "kind"}),
	}
	m.learned = &learnedRates{by: map[string]learnedSource{}}
	for _, c := range []prometheus.Collector{m.attempts, m.duration, m.learned} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("handler: registering metrics: %w", err)
		}
	}
	return m, nil
}

// known creates the series of a handler at zero, so that a rate over
// them starts with the first attempt rather than the second.
func (m *Metrics) known(handler, kind string) {
	if m == nil {
		return
	}
	for _, o := range outcomesOf[kind] {
		m.attempts.WithLabelValues(handler, kind, o)
	}
	m.duration.WithLabelValues(handler, kind)
}

func (m *Metrics) attempted(handler, kind, outcome string, d time.Duration) {
	if m == nil {
		return
	}
	m.attempts.WithLabelValues(handler, kind, outcome).Inc()
	m.duration.WithLabelValues(handler, kind).Observe(d.Seconds())
}
