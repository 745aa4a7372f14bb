package worker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// QuotaReadTimeout bounds one read of a QuotaCollector's quotas: a Redis
// that does not answer within it leaves the scrape (or the page) without
// the quotas' values, and counts an error, but never holds it up longer.
const QuotaReadTimeout = time.Second

// Quota is one calendar limit of a rules file (algorithm calendar, a
// throttle.CalendarWindow rule), with what a QuotaCollector last read of
// it.
type Quota struct {
	Rule     string            // the rule of the rules file
	Limit    string            // the limit's name, the last part of its Redis key: a policy's "<rule>.<limit>"
	Count    int               // the permits each window grants
	Calendar throttle.Calendar // its windows
	// PayloadField, if set, is the payload field the rule's subject is read
	// from: there is one quota per subject, and a worker cannot list the
	// subjects, so such a quota is never read (Read stays false).
	PayloadField string
	// Read reports whether Remaining and ResetAfter hold a value read from
	// Redis.
	Read bool
	// Remaining is how many permits the quota's current window still
	// grants: that limit's own, not the tightest of its rule's limits.
	Remaining int
	// ResetAfter is how long after the read, on the Redis clock, the
	// current window ends (at midnight of the calendar's zone), or, if
	// the quota is paused past it, the pause.
	ResetAfter time.Duration
	// At is when the read's reply came, on this machine's clock.
	At time.Time
}

// Resets is when the quota read at At resets, in its calendar's zone.
// A time within a second of a window's start (Redis's clock and this
// machine's differ by the reply's latency) is that start: midnight.
func (q Quota) Resets() time.Time {
	at := q.At.Add(q.ResetAfter)
	if start, _ := q.Calendar.Window(at.Add(time.Second)); at.Sub(start).Abs() <= time.Second {
		return start
	}
	return at.Round(time.Second).In(q.Calendar.Location())
}

// quotaSource is a Quota of the rules in force and the limiter that reads
// it: a limiter of that limit alone, under the rules' prefix, so its key.
type quotaSource struct {
	Quota
	subject string
	lim     *throttle.Limiter // nil for a quota per payload field
}

// QuotaCollector is a prometheus.Collector of what remains of the
// calendar quotas of a rules file whose subject is fixed, read from Redis
// when it is scraped:
//
//	jobthrottle_quota_remaining{rule,limit}      permits the quota's current window still grants
//	jobthrottle_quota_reset_seconds{rule,limit}  seconds until that window ends, on the Redis clock
//	jobthrottle_quota_read_errors_total          reads that failed or took longer than QuotaReadTimeout
//
// A quota whose rule reads its subject from a payload field is one quota
// per subject, which a worker cannot list: it has no metric (Quotas
// returns it unread, with the field). One read costs one Redis call per
// calendar limit of a fixed subject (an AllowN of 0 permits: it charges
// nothing), and reads at most once at a time: a scrape while a read is
// still under way counts an error instead of starting another. The
// values are the fleet's, the same from every worker: aggregate them with
// max, not sum.
type QuotaCollector struct {
	rdb     redis.UniversalClient
	reading atomic.Bool
	errors  prometheus.Counter

	mu      sync.Mutex
	sources []quotaSource // of the rules in force
	last    []Quota       // the last read's values; nil before the first
	lastAt  time.Time     // when it started, on this machine's clock
}

var (
	quotaRemainingDesc = prometheus.NewDesc("jobthrottle_quota_remaining",
		"Permits the current window of a calendar quota (algorithm calendar, fixed subject) still grants, by rule and limit. The fleet's number: aggregate with max.",
		[]string{"rule", "limit"}, nil)
	quotaResetDesc = prometheus.NewDesc("jobthrottle_quota_reset_seconds",
		"Seconds until the current window of a calendar quota (algorithm calendar, fixed subject) ends, on the Redis clock, by rule and limit.",
		[]string{"rule", "limit"}, nil)
)

// NewQuotaCollector returns a collector of the calendar quotas of cfg in
// rdb, the Redis of the rules' limiters. Register it once:
// reg.MustRegister(c); after a reload of the rules, give it the new ones
// with SetRules.
func NewQuotaCollector(rdb redis.UniversalClient, cfg *rules.Config) (*QuotaCollector, error) {
	if rdb == nil {
		return nil, errors.New("worker: NewQuotaCollector: nil Redis client; pass the rules' limiters' one")
	}
	c := &QuotaCollector{rdb: rdb, errors: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "jobthrottle",
		Name:      "quota_read_errors_total",
		Help:      "Reads of the calendar quotas that failed, or took longer than worker.QuotaReadTimeout; their quota metrics are left out.",
	})}
	if err := c.SetRules(cfg); err != nil {
		return nil, err
	}
	return c, nil
}

// SetRules makes cfg's calendar quotas the ones read, from the next read
// on (a read under way may fail, and count an error).
func (c *QuotaCollector) SetRules(cfg *rules.Config) error {
	if cfg == nil {
		return errors.New("worker: QuotaCollector.SetRules: nil rules; pass the rules in force")
	}
	var sources []quotaSource
	for _, r := range cfg.Rules {
		for _, l := range r.Limits {
			if l.Algorithm != throttle.CalendarWindow {
				continue
			}
			s := quotaSource{Quota: Quota{Rule: r.Name, Limit: l.Name, Count: l.Limit.Count, Calendar: l.Calendar, PayloadField: r.Subject.PayloadField}}
			if s.PayloadField == "" {
				// Neither FailOpen nor OnRedisError: a failed read is an
				// error of the read, not an allowed task.
				lim, err := throttle.New(c.rdb, throttle.Options{Prefix: cfg.Prefix}, l)
				if err != nil {
					closeQuotas(sources)
					return fmt.Errorf("worker: rule %q: reading its quota %q: %w", r.Name, l.Name, err)
				}
				s.subject, s.lim = r.Subject.Fixed, lim
			}
			sources = append(sources, s)
		}
	}
	c.mu.Lock()
	old := c.sources
	c.sources, c.last, c.lastAt = sources, nil, time.Time{}
	c.mu.Unlock()
	closeQuotas(old)
	return nil
}

// Close closes the limiters the collector reads with.
func (c *QuotaCollector) Close() {
	c.mu.Lock()
	old := c.sources
	c.sources, c.last = nil, nil
	c.mu.Unlock()
	closeQuotas(old)
}

func closeQuotas(sources []quotaSource) {
	for _, s := range sources {
		if s.lim != nil {
			_ = s.lim.Close()
		}
	}
}

// Describe sends the descriptors of the collector's metrics.
func (c *QuotaCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- quotaRemainingDesc
	ch <- quotaResetDesc
	c.errors.Describe(ch)
}

// Collect reads the quotas and sends their metrics; on a failed or late
// read, only the error count.
func (c *QuotaCollector) Collect(ch chan<- prometheus.Metric) {
	qs, err := c.read()
	if err != nil {
		c.errors.Inc()
		ch <- c.errors
		return
	}
	ch <- c.errors
	for _, q := range qs {
		if !q.Read {
			continue
		}
		ch <- prometheus.MustNewConstMetric(quotaRemainingDesc, prometheus.GaugeValue, float64(q.Remaining), q.Rule, q.Limit)
		ch <- prometheus.MustNewConstMetric(quotaResetDesc, prometheus.GaugeValue, q.ResetAfter.Seconds(), q.Rule, q.Limit)
	}
}

// Quotas returns every calendar quota of the rules in force, as last read
// if that read started within maxAge, else as a new read finds them
// (bounded by QuotaReadTimeout), which later calls and scrapes within
// maxAge reuse: a status page shown every second costs one read per
// maxAge. A quota per payload field is never read. If the read fails, or
// another is under way, the quotas come as the last read found them (At
// says when), or unread if none did since the rules were set, with the
// error.
func (c *QuotaCollector) Quotas(maxAge time.Duration) ([]Quota, error) {
	c.mu.Lock()
	last, at := c.last, c.lastAt
	c.mu.Unlock()
	if last != nil && time.Since(at) <= maxAge {
		return last, nil
	}
	qs, err := c.read()
	if err != nil {
		return c.lastOrUnread(), err
	}
	return qs, nil
}

// lastOrUnread is the last read's quotas, or every quota of the rules in
// force with no value.
func (c *QuotaCollector) lastOrUnread() []Quota {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last != nil {
		return c.last
	}
	qs := make([]Quota, len(c.sources))
	for i, s := range c.sources {
		qs[i] = s.Quota
	}
	return qs
}

// errQuotaReading is a read's error while an earlier one is under way.
var errQuotaReading = errors.New("worker: the previous read of the calendar quotas is still under way; it is not waited for")

// read reads every quota within QuotaReadTimeout, at most one read at a
// time (boundedRead), and keeps what it read for Quotas.
func (c *QuotaCollector) read() ([]Quota, error) {
	c.mu.Lock()
	sources := c.sources
	c.mu.Unlock()
	started := time.Now()
	qs, err := boundedRead(&c.reading, QuotaReadTimeout, errQuotaReading, "the calendar quotas",
		func(ctx context.Context) ([]Quota, error) { return readQuotas(ctx, sources) })
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if sameSources(c.sources, sources) { // not replaced by SetRules meanwhile
		c.last, c.lastAt = qs, started
	}
	c.mu.Unlock()
	return qs, nil
}

// boundedRead runs f, a read for a scrape, within timeout, unless a read
// flagged by reading is still under way: then it returns busy at once.
// f runs aside: a call that outlives the timeout (asynq's Inspector takes
// no context, and go-redis may not give up at a context's deadline) is
// left to go-redis's own timeouts while the caller goes on, and later
// reads return busy until it ends. what names what is read, in the error.
func boundedRead[T any](reading *atomic.Bool, timeout time.Duration, busy error, what string, f func(context.Context) (T, error)) (T, error) {
	var zero T
	if !reading.CompareAndSwap(false, true) {
		return zero, busy
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f(ctx)
		// Before the reply: a read that follows at once must not find
		// this one still under way.
		reading.Store(false)
		done <- result{v, err}
		cancel() // after the reply, which the caller then finds first
	}()
	select {
	case res := <-done:
		return res.v, res.err
	case <-ctx.Done():
		select {
		case res := <-done: // the reply came with the timeout
			return res.v, res.err
		default:
			return zero, fmt.Errorf("worker: reading %s: %w", what, ctx.Err())
		}
	}
}

// sameSources reports whether a and b are the same slice.
func sameSources(a, b []quotaSource) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// readQuotas reads each quota of a fixed subject with one AllowN of 0
// permits, which charges nothing.
func readQuotas(ctx context.Context, sources []quotaSource) ([]Quota, error) {
	qs := make([]Quota, len(sources))
	for i, s := range sources {
		qs[i] = s.Quota
		if s.lim == nil {
			continue
		}
		res, err := s.lim.AllowN(ctx, s.subject, 0)
		if err != nil {
			return nil, fmt.Errorf("worker: reading quota %q of rule %q: %w", s.Limit, s.Rule, err)
		}
		q := &qs[i]
		q.Read, q.Remaining, q.At = true, res.Remaining, time.Now()
		// A read of 0 is allowed unless the window is booked ahead or
		// paused; its ResetAfter is then the end of the latest window
		// booked, and its RetryAfter the end of the current one (or of
		// the pause).
		q.ResetAfter = res.ResetAfter
		if !res.Allowed {
			q.ResetAfter = res.RetryAfter
		}
	}
	return qs, nil
}
