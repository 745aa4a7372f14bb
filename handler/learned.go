package handler

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

var learnedRateDesc = prometheus.NewDesc("jobthrottle_upstream_learned_rate",
	"The rate, in requests per second, that the fleet learned for the upstream of an http handler limited by a rule: the slowest of the subjects this process sent requests for in the last minute (httpthrottle.Transport.LearnedRate); 0 while nothing is learned (the rule's limit paces alone). Read from memory when scraped: no Redis call.",
	[]string{"handler"}, nil)

// learnedRates are the http handlers' transports, by handler, each with
// its rule: a prometheus.Collector of what each learned, read from
// memory when scraped. A reload registers the handlers again and
// replaces each one's transport.
type learnedRates struct {
	mu sync.Mutex
	by map[string]learnedSource
}

// learnedSource is one handler's rule and its transport's LearnedRate.
type learnedSource struct {
	rule string
	rate func() float64
}

// learnsFrom records that handler, limited by rule, sends through a
// transport whose LearnedRate is rate.
func (m *Metrics) learnsFrom(handler, rule string, rate func() float64) {
	if m == nil {
		return
	}
	m.learned.mu.Lock()
	defer m.learned.mu.Unlock()
	m.learned.by[handler] = learnedSource{rule: rule, rate: rate}
}

// LearnedRate returns the slowest rate, in requests per second, that
// the http handlers limited by rule learned for their upstreams lately,
// as jobthrottle_upstream_learned_rate reports each; 0 if none learned one,
// and for nil Metrics. It reads memory only.
func (m *Metrics) LearnedRate(rule string) float64 {
	if m == nil {
		return 0
	}
	m.learned.mu.Lock()
	defer m.learned.mu.Unlock()
	slowest := 0.0
	for _, s := range m.learned.by {
		if r := s.rate(); s.rule == rule && r > 0 && (slowest == 0 || r < slowest) {
			slowest = r
		}
	}
	return slowest
}

// Describe sends the descriptor.
func (l *learnedRates) Describe(ch chan<- *prometheus.Desc) { ch <- learnedRateDesc }

// Collect sends each handler's learned rate.
func (l *learnedRates) Collect(ch chan<- prometheus.Metric) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for handler, s := range l.by {
		ch <- prometheus.MustNewConstMetric(learnedRateDesc, prometheus.GaugeValue, s.rate(), handler)
	}
}
