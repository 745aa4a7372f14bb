package worker

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of a throttled task, the values of the outcome label of
// jobthrottle_decisions_total.
const (
	OutcomeAdmitted = "admitted" // admitted at once (a wait under WaitThreshold)
	OutcomeWaited   = "waited"   // admitted after waiting in the handler
	OutcomeRedeemed = "redeemed" // admitted on a receipt prepaid at enqueue time (ReceiptHeader)
	OutcomeDeferred = "deferred" // deferred with a *ThrottledError for its RetryAt
	OutcomeRefunded = "refunded" // the task's context ended while waiting; its permits were refunded
	OutcomeError    = "error"    // no subject (archived), or Redis failed (deferred)
)

// WaitThreshold is the wait below which an admission counts as
// OutcomeAdmitted rather than OutcomeWaited: about a Redis round trip.
const WaitThreshold = 5 * time.Millisecond

// Metrics are the middleware's Prometheus metrics. Their only labels are
// the rule's name and the outcome: never a subject (unbounded cardinality,
// and possibly personal data) nor anything from a payload.
//
//	jobthrottle_wait_seconds{rule}            histogram of the time admitted tasks waited
//	jobthrottle_decisions_total{rule,outcome} tasks by outcome (see the Outcome constants)
//	jobthrottle_waiters{rule}                 tasks waiting in handlers now
//	jobthrottle_redis_errors_total            errors from Redis seen by the limiters
//
// A nil *Metrics records nothing. Pass one to the middleware with
// WithMetrics; Config.Middleware also wires OnRedisError into the limiters
// it builds.
type Metrics struct {
	wait        *prometheus.HistogramVec
	decisions   *prometheus.CounterVec
	waiters     *prometheus.GaugeVec
	redisErrors prometheus.Counter
}

// NewMetrics creates the metrics and registers them on reg. It returns an
// error if reg is nil or already has metrics of these names.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	if reg == nil {
		return nil, fmt.Errorf("worker: NewMetrics: nil prometheus.Registerer; pass prometheus.DefaultRegisterer or a prometheus.NewRegistry()")
	}
	m := &Metrics{
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "jobthrottle",
			Name:      "wait_seconds",
			Help:      "Time tasks waited in the handler for their permits, by rule (admitted tasks only).",
			Buckets:   []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}, []string{"rule"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "decisions_total",
			Help:      "Throttled tasks by rule and outcome: admitted, waited, redeemed, deferred, refunded, error.",
		}, []string{"rule", "outcome"}),
		waiters: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "jobthrottle",
			Name:      "waiters",
			Help:      "Tasks waiting in handlers for their permits now, by rule.",
		}, []string{"rule"}),
		redisErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "redis_errors_total",
			Help:      "Errors from Redis seen by the limiters (admitted anyway if fail_open).",
		}),
	}
	for _, c := range []prometheus.Collector{m.wait, m.decisions, m.waiters, m.redisErrors} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("worker: registering metrics: %w", err)
		}
	}
	return m, nil
}

// OnRedisError counts an error from Redis. Its signature fits
// throttle.Options.OnRedisError.
func (m *Metrics) OnRedisError(err error, failedOpen bool) {
	if m != nil {
		m.redisErrors.Inc()
	}
}

func (m *Metrics) decided(rule, outcome string) {
	if m != nil {
		m.decisions.WithLabelValues(rule, outcome).Inc()
	}
}

func (m *Metrics) waited(rule string, d time.Duration) {
	if m != nil {
		m.wait.WithLabelValues(rule).Observe(d.Seconds())
	}
}

func (m *Metrics) waiting(rule string, delta float64) {
	if m != nil {
		m.waiters.WithLabelValues(rule).Add(delta)
	}
}
