package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
)

// QueueReadTimeout bounds the reads of one scrape of a QueueCollector: a
// Redis that does not answer within it leaves the scrape without the
// queue metrics (and counts an error), never holds it up.
const QueueReadTimeout = time.Second

// queueStates are the asynq task states a QueueCollector reports, the
// values of the state label of jobthrottle_queue_tasks.
var queueStates = [...]string{"pending", "active", "scheduled", "retry", "archived", "completed"}

// QueueCollector is a prometheus.Collector of what waits in asynq's Redis,
// read when it is scraped, so that a worker that nobody scrapes costs
// nothing:
//
//	jobthrottle_queue_tasks{queue,state}      tasks in each queue by state: pending, active, scheduled, retry, archived, completed
//	jobthrottle_queue_latency_seconds{queue}  how long the oldest pending task of the queue has waited
//	jobthrottle_wakeup_ledger_members         parked tasks waiting for their booked turns, of every rule and worker, plus one per subject whose line or concurrency limit has a serving scheduled
//	jobthrottle_queue_read_errors_total       scrapes whose reads failed or took longer than QueueReadTimeout
//
// Parked tasks sit in asynq's retry set: retry counts them with the tasks
// that failed and wait for a retry. These are the fleet's numbers, the
// same from every worker of one Redis: aggregate them with max, not sum.
// One scrape costs 1 + 3 × queues + shards Redis calls (SMEMBERS of
// asynq's queues; per queue that exists, a SISMEMBER and asynq's two
// statistics scripts; a ZCARD per shard of the ledger), whatever the
// number of tasks, and
// reads at most once at a time: a scrape while a read is still under way
// counts an error instead of starting another.
type QueueCollector struct {
	insp    *asynq.Inspector
	wakeups *admission.Wakeups
	queues  []string
	reading atomic.Bool
	errors  prometheus.Counter
}

var (
	queueTasksDesc = prometheus.NewDesc("jobthrottle_queue_tasks",
		"Tasks in an asynq queue now, by queue and state (pending, active, scheduled, retry, archived, completed). Parked tasks are in retry. The fleet's numbers: aggregate with max.",
		[]string{"queue", "state"}, nil)
	queueLatencyDesc = prometheus.NewDesc("jobthrottle_queue_latency_seconds",
		"How long the oldest pending task of an asynq queue has waited, by queue; 0 when none is pending.",
		[]string{"queue"}, nil)
	ledgerDesc = prometheus.NewDesc("jobthrottle_wakeup_ledger_members",
		"Parked tasks waiting in the wake-up ledger for their booked turns, of every rule and worker, plus one per subject whose line or concurrency limit has a serving scheduled. The fleet's number: aggregate with max.",
		nil, nil)
)

// NewQueueCollector returns a collector of queues' sizes in rdb, the
// asynq server's Redis (the worker's Options.Asynq), which holds the
// wake-up ledger too. Register it once: reg.MustRegister(c). queues are the
// queues the worker serves (asynq.Config.Queues); one that has never held
// a task reports zeros.
//
// The ledger counted is one of admission.DefaultWakeupShards shards, unless
// a LedgerShards option says otherwise (the workers' Options.WakeupShards).
func NewQueueCollector(rdb redis.UniversalClient, queues []string, opts ...QueueOption) (*QueueCollector, error) {
	if rdb == nil {
		return nil, errors.New("worker: NewQueueCollector: nil Redis client; pass the asynq server's")
	}
	if len(queues) == 0 {
		return nil, errors.New(`worker: NewQueueCollector: no queues; pass the asynq server's, such as "default"`)
	}
	var cfg queueConfig
	for _, o := range opts {
		o.applyQueue(&cfg)
	}
	wakeups, err := admission.NewShardedWakeups(rdb, admission.WakeupsKey, cfg.shards)
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	q := slices.Clone(queues)
	slices.Sort(q)
	return &QueueCollector{
		insp:    asynq.NewInspectorFromRedisClient(rdb),
		wakeups: wakeups,
		queues:  slices.Compact(q),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "jobthrottle",
			Name:      "queue_read_errors_total",
			Help:      "Scrapes whose reads of the asynq queues failed, or took longer than worker.QueueReadTimeout; their queue metrics are left out.",
		}),
	}, nil
}

// A QueueOption tunes NewQueueCollector.
type QueueOption interface{ applyQueue(*queueConfig) }

type queueConfig struct{ shards int }

// LedgerShards is the QueueOption that gives the number of keys of the
// workers' wake-up ledger (Options.WakeupShards), all of which
// jobthrottle_wakeup_ledger_members counts.
type LedgerShards int

func (n LedgerShards) applyQueue(c *queueConfig) { c.shards = int(n) }

// Describe sends the descriptors of the collector's metrics.
func (c *QueueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- queueTasksDesc
	ch <- queueLatencyDesc
	ch <- ledgerDesc
	c.errors.Describe(ch)
}

// Collect reads the queues and sends their metrics; on a failed or late
// read, only the error count.
func (c *QueueCollector) Collect(ch chan<- prometheus.Metric) {
	r, err := c.read()
	if err != nil {
		c.errors.Inc()
		ch <- c.errors
		return
	}
	ch <- c.errors
	for _, q := range r.queues {
		for i, state := range queueStates {
			ch <- prometheus.MustNewConstMetric(queueTasksDesc, prometheus.GaugeValue, float64(q.sizes[i]), q.name, state)
		}
		ch <- prometheus.MustNewConstMetric(queueLatencyDesc, prometheus.GaugeValue, q.latency.Seconds(), q.name)
	}
	ch <- prometheus.MustNewConstMetric(ledgerDesc, prometheus.GaugeValue, float64(r.ledger))
}

// queueRead is one scrape's reads.
type queueRead struct {
	queues []queueSizes
	ledger int64
}

// queueSizes are one queue's tasks by state, in the order of queueStates.
type queueSizes struct {
	name    string
	sizes   [len(queueStates)]int
	latency time.Duration
}

// errReading is a scrape's error while an earlier scrape's read is still
// under way.
var errReading = errors.New("worker: the previous read of the queues is still under way")

// read reads the queues within QueueReadTimeout, at most one read at a
// time (boundedRead). asynq's Inspector takes no context: its reads run
// aside, and one that outlives the timeout is left to go-redis's own
// timeouts while later scrapes fail at once.
func (c *QueueCollector) read() (queueRead, error) {
	return boundedRead(&c.reading, QueueReadTimeout, errReading, "the queues", c.readAll)
}

func (c *QueueCollector) readAll(ctx context.Context) (queueRead, error) {
	known, err := c.insp.Queues()
	if err != nil {
		return queueRead{}, err
	}
	var r queueRead
	for _, name := range c.queues {
		q := queueSizes{name: name}
		if slices.Contains(known, name) {
			info, err := c.insp.GetQueueInfo(name)
			if err != nil {
				return queueRead{}, err
			}
			q.sizes = [len(queueStates)]int{info.Pending, info.Active, info.Scheduled, info.Retry, info.Archived, info.Completed}
			q.latency = info.Latency
		}
		r.queues = append(r.queues, q)
	}
	if r.ledger, err = c.wakeups.Len(ctx); err != nil {
		return queueRead{}, err
	}
	return r, nil
}
