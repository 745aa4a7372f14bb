package worker

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Metrics are the middleware's Prometheus metrics. Their only labels are
// the rule's name and the outcome: never a subject (unbounded cardinality,
// and possibly personal data) nor anything from a payload.
//
//	jobthrottle_wait_seconds{rule}            histogram of the time admitted tasks waited in their handlers
//	jobthrottle_start_delay_seconds{rule}     histogram of the time from enqueue to start (tasks with admission.EnqueuedHeader)
//	jobthrottle_decisions_total{rule,outcome} tasks by outcome (admission's Label constants)
//	jobthrottle_waiters{rule}                 tasks waiting in handlers now
//	jobthrottle_booked_ahead_seconds{rule}    how far ahead the latest parked task's turn was booked
//	jobthrottle_wakeups_total                 parked tasks this process moved to pending at their turns
//	jobthrottle_redis_errors_total            errors from Redis seen by the limiters
//	jobthrottle_places_held{rule}             tasks of a concurrency rule running in this process, each holding a place
//	jobthrottle_line_turns_total{rule}        turns this process booked for tasks waiting in a subject's line
//	jobthrottle_booked_turns{rule}            turns this process booked for parked tasks (or serving a line) that have not come yet
//	jobthrottle_furthest_turn_seconds{rule}   how far ahead of now the furthest of those turns is
//	jobthrottle_line_waiting{rule}            tasks waiting in the lines this process serves, as its last serving of each counted them
//	jobthrottle_redis_calls_total{kind,call}  commands this process sent to Redis for jobthrottle, by script or command (CountRedisCalls)
//
// The booked turns, the furthest turn and the line waiting are kept in
// memory and computed when scraped: they cost no Redis call (a serving's
// reply carries its line's length). The Redis calls are counted only on
// the clients given to CountRedisCalls; their label is a script's or a
// command's name, never a key.
//
// A nil *Metrics records nothing. Pass one to the middleware with
// Options.Metrics; FromRules also wires OnRedisError into the limiters
// it builds.
type Metrics struct {
	wait        *prometheus.HistogramVec
	delays      *prometheus.HistogramVec
	decisions   *prometheus.CounterVec
	activity    *Activity // the decisions and turns again, in memory, for a status page (activity.go)
	waiters     *prometheus.GaugeVec
	ahead       *prometheus.GaugeVec
	wakeups     prometheus.Counter
	redisErrors prometheus.Counter
	places      *prometheus.GaugeVec
	lineTurns   *prometheus.CounterVec
	redisCalls  *prometheus.CounterVec
	turns       *turnBook
	lines       *lineBook
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
		delays: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "jobthrottle",
			Name:      "start_delay_seconds",
			Help:      "Time from enqueue to start, by rule, for tasks whose producer recorded it (admission.EnqueuedHeader): queue time, parking and waiting together.",
			Buckets:   []float64{.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 3600},
		}, []string{"rule"}),
		ahead: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "jobthrottle",
			Name:      "booked_ahead_seconds",
			Help:      "How far ahead the turn of the latest task parked by this process was booked, by rule: the depth of the backlog in time.",
		}, []string{"rule"}),
		wakeups: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "wakeups_total",
			Help:      "Parked tasks this process moved to their queues' pending lists just before their turns.",
		}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "decisions_total",
			Help:      "Throttled tasks by rule and outcome: admitted, waited, redeemed, parked, deferred, refunded, error.",
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
	m.places = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "jobthrottle",
		Name:      "places_held",
		Help:      "Tasks of a concurrency rule running in this process now, each holding one of the rule's places, by rule.",
	}, []string{"rule"})
	m.lineTurns = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "jobthrottle",
		Name:      "line_turns_total",
		Help:      "Turns this process booked, serving a subject's line, for tasks that waited in it past the rule's horizon, by rule.",
	}, []string{"rule"})
	m.redisCalls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "jobthrottle",
		Name:      "redis_calls_total",
		Help:      "Commands this process sent to Redis for jobthrottle: kind script by the script's name (admit, bucket_fast, upstream_depart, wake_pop, ...), kind command (on a key under the prefix) by the command's name.",
	}, []string{"kind", "call"})
	m.turns, m.lines = &turnBook{}, &lineBook{}
	m.activity = &Activity{turns: m.turns, lines: m.lines}
	for _, c := range []prometheus.Collector{m.wait, m.delays, m.decisions, m.waiters, m.ahead, m.wakeups, m.redisErrors, m.places, m.lineTurns, m.redisCalls, m.turns, m.lines} {
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
		m.activity.decided(rule, outcome)
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

func (m *Metrics) startDelay(rule string, d time.Duration) {
	if m != nil {
		m.delays.WithLabelValues(rule).Observe(d.Seconds())
	}
}

// parkedOn records the turn d that a task of rule parked on, booked
// ahead by ahead. A held turn (the task came back early) was counted in
// the turn book when it was booked.
func (m *Metrics) parkedOn(rule string, d admission.Decision, ahead time.Duration) {
	if m == nil {
		return
	}
	m.ahead.WithLabelValues(rule).Set(ahead.Seconds())
	if d.Status == throttle.Booked {
		m.turns.add(rule, d.At)
	}
}

func (m *Metrics) woken() {
	if m != nil {
		m.wakeups.Inc()
	}
}

func (m *Metrics) holding(rule string, delta float64) {
	if m != nil {
		m.places.WithLabelValues(rule).Add(delta)
	}
}

// lineServed records a serving of rule's line of subject: the turns it
// booked, by task, each with its slot on the Redis clock (taken as the
// local one, as the wake-ups take it), and how many tasks still wait in
// the line.
func (m *Metrics) lineServed(rule, subject string, s admission.Served) {
	if m == nil {
		return
	}
	m.lines.served(rule, subject, s.Waiting, s.Next)
	if len(s.Handed) == 0 {
		return
	}
	m.lineTurns.WithLabelValues(rule).Add(float64(len(s.Handed)))
	for _, slot := range s.Handed {
		m.turns.add(rule, slot)
	}
}
