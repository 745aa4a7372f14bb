package enqueue

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// SchedulerOptions configure a Scheduler.
type SchedulerOptions struct {
	// Redis holds the workers' ledger, for paced schedules. Required if
	// any schedule is paced.
	Redis redis.UniversalClient
	// Client enqueues the tasks. Required.
	Client Enqueuer
	// Logger receives a line per firing, per overlap and per batch. If nil,
	// slog.Default() is used.
	Logger *slog.Logger
	// OnBatch, if set, is called after each firing's batch is enqueued (or
	// failed), before the firing waits for its last task to be due.
	OnBatch func(schedule string, res Summary, err error)
	// OnEnqueued, if set, is called after each task is enqueued
	// (Batch.OnEnqueued).
	OnEnqueued func(schedule string, e Enqueued)
}

// A Scheduler enqueues each schedule's batch when its cron spec fires.
//
// A firing lasts until its batch is enqueued and its last task is due (the
// batch's slot span when paced), so that a firing that comes while the
// previous batch is still arriving is an overlap: skipped or delayed as the
// schedule's overlap says, and logged; it never enqueues a second batch on
// top of the first.
type Scheduler struct {
	cron    *cron.Cron
	log     *slog.Logger
	jobs    []*job
	started atomic.Bool
}

// NewScheduler prepares s's schedules. s should come from LoadSchedules
// (payload files and the workers' rules loaded). It builds each paced
// schedule's limiter; errors name the schedule.
func NewScheduler(s *Schedules, opts SchedulerOptions) (*Scheduler, error) {
	if opts.Client == nil {
		return nil, errors.New("enqueue: NewScheduler: nil Client")
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	sch := &Scheduler{cron: cron.New(cron.WithLogger(cron.DiscardLogger)), log: log}
	for i := range s.Schedules {
		sc := &s.Schedules[i]
		j := &job{name: sc.Name, log: log.With("schedule", sc.Name), onBatch: opts.OnBatch, client: opts.Client}
		if sc.Payloads != "" && sc.loaded == nil {
			return nil, fmt.Errorf("enqueue: schedule %q: payloads %s not loaded; use LoadSchedules", sc.Name, sc.Payloads)
		}
		j.batch = sc.batch()
		if f := opts.OnEnqueued; f != nil {
			name := sc.Name
			j.batch.OnEnqueued = func(e Enqueued) { f(name, e) }
		}
		j.batch.OnPlan = func(p Plan) {
			if p.Paced {
				j.log.Info("enqueue: "+p.Describe(), "ahead", p.Ahead.Round(time.Millisecond))
			}
		}
		if sc.Pace != nil {
			if opts.Redis == nil {
				return nil, fmt.Errorf("enqueue: schedule %q is paced but SchedulerOptions.Redis is nil", sc.Name)
			}
			if sc.Pace.Limit.Count == 0 && sc.Pace.Rules == nil {
				sc.Pace.Rules = s.RulesConfig
			}
			if sc.Pace.Limit.Count == 0 && sc.Pace.Rules == nil {
				return nil, fmt.Errorf("enqueue: schedule %q is paced under the workers' rules file, which is not loaded; use LoadSchedules", sc.Name)
			}
			p, err := sc.Pace.Pacer(opts.Redis, sc.Type, throttle.Options{Logger: log})
			if err != nil {
				return nil, fmt.Errorf("enqueue: schedule %q: %w", sc.Name, err)
			}
			j.batch.Pacer = p
		}
		if err := j.batch.Validate(); err != nil {
			return nil, fmt.Errorf("enqueue: schedule %q: %w", sc.Name, err)
		}
		policy := cron.SkipIfStillRunning(cronLogger{j.log})
		if sc.Overlap == OverlapDelay {
			policy = delayIfStillRunning(j.log)
		}
		j.id = sch.cron.Schedule(sc.schedule, cron.NewChain(policy).Then(j))
		sch.jobs = append(sch.jobs, j)
	}
	return sch, nil
}

// Run starts the schedules and blocks until ctx ends. Then it stops
// firing, cancels the firings under way (a batch stops between two tasks;
// tasks already enqueued stay) and waits for them to return. It can be
// called once.
func (s *Scheduler) Run(ctx context.Context) error {
	if s.started.Swap(true) {
		return errors.New("enqueue: Scheduler.Run called twice")
	}
	for _, j := range s.jobs {
		j.ctx = ctx
	}
	s.cron.Start()
	for _, j := range s.jobs {
		s.log.Info("enqueue: schedule started", "schedule", j.name, "next", s.cron.Entry(j.id).Next.Format(time.RFC3339))
	}
	<-ctx.Done()
	<-s.cron.Stop().Done()
	return nil
}

// job is one schedule's firing.
type job struct {
	name    string
	id      cron.EntryID
	ctx     context.Context
	log     *slog.Logger
	client  Enqueuer
	batch   Batch
	onBatch func(string, Summary, error)
	firings atomic.Int64
}

// cronLogger passes robfig/cron's wrapper messages to slog: "skip" is
// SkipIfStillRunning dropping a firing.
type cronLogger struct{ log *slog.Logger }

func (l cronLogger) Info(msg string, kv ...any) {
	if msg == "skip" {
		l.log.Warn("enqueue: firing skipped: the previous batch is still arriving (overlap: skip)")
		return
	}
	l.log.Info("cron: "+msg, kv...)
}

func (l cronLogger) Error(err error, msg string, kv ...any) {
	l.log.Error("cron: "+msg, append(kv, "error", err)...)
}

// delayIfStillRunning is cron.DelayIfStillRunning, except that it logs
// every delayed firing (cron's logs only delays over a minute) and waits
// on a channel rather than a sync.Mutex, which testing/synctest cannot see
// as blocked.
func delayIfStillRunning(log *slog.Logger) cron.JobWrapper {
	return func(j cron.Job) cron.Job {
		lock := make(chan struct{}, 1)
		return cron.FuncJob(func() {
			select {
			case lock <- struct{}{}:
			default:
				log.Warn("enqueue: firing delayed: the previous batch is still arriving (overlap: delay)")
				start := time.Now()
				lock <- struct{}{}
				log.Info("enqueue: delayed firing runs", "delayed", time.Since(start).Round(time.Millisecond))
			}
			defer func() { <-lock }()
			j.Run()
		})
	}
}

// Run enqueues one batch, then holds the firing until its last task is
// due.
func (j *job) Run() {
	if j.ctx == nil || j.ctx.Err() != nil {
		return
	}
	n := j.firings.Add(1)
	start := time.Now()
	j.log.Info("enqueue: firing", "firing", n, "type", j.batch.Type, "tasks", j.batch.size(), "paced", j.batch.Pacer != nil)
	res, err := j.batch.Run(j.ctx, j.client)
	if j.onBatch != nil {
		j.onBatch(j.name, res, err)
	}
	if err != nil {
		j.log.Error("enqueue: batch failed", "firing", n, "enqueued", res.Enqueued, "error", err)
		return
	}
	j.log.Info("enqueue: batch enqueued", "firing", n, "enqueued", res.Enqueued,
		"took", time.Since(start).Round(time.Millisecond), "last_due_in", time.Until(res.LastDue).Round(time.Millisecond))
	if d := time.Until(res.LastDue); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-j.ctx.Done():
		}
	}
}
