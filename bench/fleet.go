package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// A fleet is asynq servers (worker processes, in this process) on one
// redis-server, each with its own go-redis clients, behind the worker
// middleware. It counts what issue 9's targets are about: the limiter's
// script calls (a hook on the limiters' own clients), asynq dequeues (an
// outer middleware sees every task asynq hands a worker), parks and
// deferrals (the ErrorHandler), and every handler start with its turn.

// The two ways the benchmark admits a task.
const (
	// modeParking is the rule's *throttle.Limiter: a task that cannot run
	// soon parks on a turn booked under its ID.
	modeParking = "parking"
	// modeDeferral hides the limiter behind waitOnly, so the middleware
	// waits in place up to MaxWait and otherwise defers the task to the
	// limiter's estimate, booking nothing: the behaviour before parking.
	modeDeferral = "deferral"
)

// waitOnly is a *throttle.Limiter that only waits: the middleware cannot
// book turns with it.
type waitOnly struct{ l *throttle.Limiter }

func (w waitOnly) WaitN(ctx context.Context, subject string, n int) error {
	return w.l.WaitN(ctx, subject, n)
}

// fleetSpec is how a fleet's servers admit tasks.
type fleetSpec struct {
	mode        string
	rule        throttle.Rule
	prefix      string // the limiter's key prefix
	maxWait     time.Duration
	concurrency int
	// fixed, if set, is every task's subject (one API key) instead of
	// the payload's tenant; fairBy then shares it fairly among the
	// tenants, and shareLimit, if set, limits each tenant on its own.
	fixed      string
	fairBy     bool
	shareLimit throttle.Limit
	// taskRules, if set, builds the servers' rules in place of rule's,
	// their limiters on limRDB (whose script calls the fleet counts) under
	// prefix: the features part's stacked, priority and calendar rules.
	taskRules func(limRDB *redis.Client, prefix string) ([]worker.TaskRule, error)
}

// taskStart is one handler start.
type taskStart struct {
	id, subject string
	tenant, key string    // the payload's tenant and key
	prio        int       // the payload's p
	at          time.Time // local clock
	turn        time.Time // the turn on the Redis clock; zero without one (deferral)
	redeemed    bool      // it ran on a turn booked before it came (parked, or paced)
}

type fleet struct {
	addr  string
	spec  fleetSpec
	admin *redis.Client // the harness's: enqueue, INFO
	cli   *asynq.Client

	calls, dequeues           atomic.Int64
	parks, deferrals, drained atomic.Int64
	otherErrs                 atomic.Int64
	mu                        sync.Mutex
	starts                    []taskStart
	enqueued                  map[string]time.Time // task ID → enqueued (only where asked)
	firstErr                  string
	servers                   []*fleetServer
	idleUsecPerS              float64   // Redis time the idle fleet's polling costs
	since                     time.Time // when the tasks' statistics begin
}

type fleetServer struct {
	srv     *asynq.Server
	mw      *worker.Middleware
	clients []*redis.Client
}

// newFleet flushes the server and returns a fleet with no workers yet.
func newFleet(ctx context.Context, addr string, spec fleetSpec) (*fleet, error) {
	admin := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 32})
	if err := admin.FlushAll(ctx).Err(); err != nil {
		admin.Close()
		return nil, err
	}
	return &fleet{addr: addr, spec: spec, admin: admin, cli: asynq.NewClientFromRedisClient(admin), enqueued: map[string]time.Time{}}, nil
}

// openFleet returns a fleet of servers workers on a flushed server, and
// the server's statistics before any task.
func openFleet(ctx context.Context, addr string, spec fleetSpec, servers int) (*fleet, serverStats, error) {
	f, err := newFleet(ctx, addr, spec)
	if err != nil {
		return nil, serverStats{}, err
	}
	err = f.start(servers)
	var idle, before serverStats
	if err == nil {
		idle, err = readStats(ctx, f.admin)
	}
	if err == nil {
		time.Sleep(idleProbe)
		before, err = readStats(ctx, f.admin)
	}
	if err != nil {
		f.close()
		return nil, serverStats{}, err
	}
	f.idleUsecPerS = float64(usecDelta(idle, before)) / idleProbe.Seconds()
	f.since = time.Now()
	return f, before, nil
}

// idleProbe is how long a new fleet idles while the Redis time its
// servers' polling costs is measured.
const idleProbe = 2 * time.Second

// usecDelta is the Redis time (INFO commandstats usec) of every command
// but the harness's between two readings.
func usecDelta(a, b serverStats) int64 {
	var usec int64
	for name, u := range b.Usec {
		if !adminCommand(name) {
			usec += u - a.Usec[name]
		}
	}
	return usec
}

// finish returns the starts so far and sets c to what the fleet counted
// over n tasks since before, and done to the distinct tasks started.
func (f *fleet) finish(ctx context.Context, n int, before serverStats, c *counts, done *int) ([]taskStart, error) {
	starts := f.snapshot()
	after, err := readStats(ctx, f.admin)
	if err != nil {
		return nil, err
	}
	*c = f.counts(n, before, after, starts)
	*done = len(starts) - c.DuplicateStarts
	return starts, nil
}

// limiter returns a *throttle.Limiter on its own client whose script
// calls the fleet counts.
func (f *fleet) limiter(prefix string) (*throttle.Limiter, *redis.Client, error) {
	rdb := redis.NewClient(&redis.Options{Addr: f.addr})
	rdb.AddHook(scriptCount{&f.calls})
	lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, f.spec.rule)
	if err != nil {
		rdb.Close()
		return nil, nil, err
	}
	return lim, rdb, nil
}

// start starts n worker servers.
func (f *fleet) start(n int) error {
	for range n {
		if err := f.startOne(); err != nil {
			return err
		}
	}
	return nil
}

func (f *fleet) startOne() error {
	lim, limRDB, err := f.limiter(f.spec.prefix)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(&redis.Options{Addr: f.addr})
	var waiter worker.Waiter = lim
	if f.spec.mode == modeDeferral {
		waiter = waitOnly{lim}
	}
	rule := worker.TaskRule{Name: f.spec.rule.Name, Tasks: []string{"job:*"}, Limiter: waiter,
		Subject: worker.PayloadField("tenant"), Settings: admission.Settings{MaxWait: f.spec.maxWait}}
	if f.spec.fixed != "" {
		rule.Subject = worker.Fixed(f.spec.fixed)
	}
	if f.spec.fairBy {
		rule.FairBy, rule.ShareLimit = worker.PayloadField("tenant"), f.spec.shareLimit
	}
	taskRules := []worker.TaskRule{rule}
	if f.spec.taskRules != nil {
		taskRules, err = f.spec.taskRules(limRDB, f.spec.prefix)
	}
	var mw *worker.Middleware
	if err == nil {
		mw, err = worker.NewMiddleware(taskRules, worker.Options{Asynq: rdb, Logger: slog.New(slog.DiscardHandler)})
	}
	if err != nil {
		rdb.Close()
		limRDB.Close()
		return err
	}
	mux := asynq.NewServeMux()
	mux.Use(func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			f.dequeues.Add(1)
			return next.ProcessTask(ctx, t)
		})
	}, mw.Wrap)
	mux.HandleFunc("job:", func(ctx context.Context, t *asynq.Task) error {
		at := time.Now()
		w, _ := admission.WaitedFrom(ctx)
		id, _ := asynq.GetTaskID(ctx)
		var p struct {
			Tenant, Key string
			P           int
		}
		_ = json.Unmarshal(t.Payload(), &p)
		f.mu.Lock()
		f.starts = append(f.starts, taskStart{id: id, subject: w.Subject, tenant: p.Tenant, key: p.Key, prio: p.P, at: at, turn: w.Turn, redeemed: w.Redeemed})
		f.mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency:     f.spec.concurrency,
		LogLevel:        asynq.FatalLevel,
		ShutdownTimeout: 2 * time.Second,
		ErrorHandler:    asynq.ErrorHandlerFunc(f.handleError),
	}))
	if err := srv.Start(mux); err != nil {
		mw.Drain()
		rdb.Close()
		limRDB.Close()
		return err
	}
	f.servers = append(f.servers, &fleetServer{srv: srv, mw: mw, clients: []*redis.Client{rdb, limRDB}})
	return nil
}

func (f *fleet) handleError(_ context.Context, _ *asynq.Task, err error) {
	var te *admission.ThrottledError
	switch {
	case errors.Is(err, worker.ErrParked):
		f.parks.Add(1)
	case errors.Is(err, worker.ErrDraining):
		f.drained.Add(1)
	case errors.As(err, &te):
		f.deferrals.Add(1)
	default:
		f.otherErrs.Add(1)
		f.mu.Lock()
		if f.firstErr == "" {
			f.firstErr = err.Error()
		}
		f.mu.Unlock()
	}
}

// stop stops every worker server as a fleet would on shutdown: stop
// taking tasks, drain the waiting ones, shut down.
func (f *fleet) stop() {
	var wg sync.WaitGroup
	for _, s := range f.servers {
		wg.Go(func() {
			s.srv.Stop()
			s.mw.Drain()
			s.srv.Shutdown()
			for _, c := range s.clients {
				c.Close()
			}
		})
	}
	wg.Wait()
	f.servers = nil
}

// close stops the fleet and closes the harness's client.
func (f *fleet) close() {
	f.stop()
	f.cli.Close()
	f.admin.Close()
}

// enqueueProducers is how many goroutines enqueue a backlog.
const enqueueProducers = 8

// enqueue enqueues n tasks of tenant at once, over parallel producers,
// and returns when the last is in. If record, their enqueue times are kept.
func (f *fleet) enqueue(ctx context.Context, tenant string, n int, record bool) error {
	payload := fmt.Appendf(nil, `{"tenant":%q}`, tenant)
	return f.enqueueEach(ctx, n, func(int) []byte { return payload }, record)
}

// enqueueEach enqueues n tasks at once, task i with payload(i), over
// parallel producers (each taking every producers-th task, in order),
// and returns when the last is in. If record, their enqueue times are
// kept.
func (f *fleet) enqueueEach(ctx context.Context, n int, payload func(i int) []byte, record bool) error {
	const producers = enqueueProducers
	var wg sync.WaitGroup
	errs := make([]error, producers)
	for p := range producers {
		wg.Go(func() {
			for i := p; i < n; i += producers {
				info, err := f.cli.EnqueueContext(ctx, asynq.NewTask("job:call", payload(i)))
				if err != nil {
					errs[p] = err
					return
				}
				if record {
					now := time.Now()
					f.mu.Lock()
					f.enqueued[info.ID] = now
					f.mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// waitStarts waits until n handlers have started or until end, and
// reports whether they did.
func (f *fleet) waitStarts(n int, end time.Time) bool {
	for {
		if f.started() >= n {
			return true
		}
		if time.Now().After(end) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (f *fleet) started() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.starts)
}

func (f *fleet) snapshot() []taskStart {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.starts)
}

// counts is what a fleet counted, per task.
type counts struct {
	LimiterCalls int64  `json:"limiter_calls"`
	Dequeues     int64  `json:"dequeues"`
	Parks        int64  `json:"parks"`
	Deferrals    int64  `json:"deferrals"`
	Drained      int64  `json:"drained,omitempty"`
	OtherErrors  int64  `json:"other_errors"`
	FirstError   string `json:"first_error,omitempty"`
	// Per task: over the tasks enqueued.
	CallsPerTask    float64 `json:"limiter_calls_per_task"`
	DequeuesPerTask float64 `json:"dequeues_per_task"`
	// ParksPerTask is parks plus deferrals per task (one of the two is 0).
	ParksPerTask float64 `json:"parks_or_deferrals_per_task"`
	// RedisUsecPerTask is INFO commandstats' usec over every command
	// (asynq's included) per task; RedisCPUmsPerTask is used_cpu_user +
	// used_cpu_sys.
	RedisUsecPerTask  float64 `json:"redis_usec_per_task"`
	RedisCPUmsPerTask float64 `json:"redis_cpu_ms_per_task"`
	// IdleUsecPerS is the Redis time per second of the fleet idle (asynq's
	// polling), measured before the tasks; NetUsecPerTask is
	// RedisUsecPerTask less that rate over the run (meaningless where the
	// fleet was stopped for a while).
	IdleUsecPerS   float64 `json:"idle_usec_per_s"`
	NetUsecPerTask float64 `json:"net_usec_per_task"`
	// DuplicateStarts counts handler starts beyond the first of a task.
	DuplicateStarts int `json:"duplicate_starts"`
	// Redeemed counts the tasks that ran on a turn booked before they
	// came (when they parked, or by their producer): the others took a
	// new turn when they ran, e.g. because they came back later than the
	// tolerance and their booked turn had lapsed.
	Redeemed int `json:"redeemed"`
}

func (f *fleet) counts(n int, before, after serverStats, starts []taskStart) counts {
	c := counts{LimiterCalls: f.calls.Load(), Dequeues: f.dequeues.Load(), Parks: f.parks.Load(),
		Deferrals: f.deferrals.Load(), Drained: f.drained.Load(), OtherErrors: f.otherErrs.Load()}
	f.mu.Lock()
	c.FirstError = f.firstErr
	f.mu.Unlock()
	per := func(x float64) float64 { return x / float64(max(n, 1)) }
	c.CallsPerTask, c.DequeuesPerTask = per(float64(c.LimiterCalls)), per(float64(c.Dequeues))
	c.ParksPerTask = per(float64(c.Parks + c.Deferrals))
	usec := float64(usecDelta(before, after))
	c.RedisUsecPerTask = per(usec)
	c.IdleUsecPerS = f.idleUsecPerS
	c.NetUsecPerTask = per(usec - f.idleUsecPerS*time.Since(f.since).Seconds())
	c.RedisCPUmsPerTask = per((after.CPU - before.CPU) * 1000)
	seen := map[string]bool{}
	for _, s := range starts {
		if s.redeemed {
			c.Redeemed++
		}
		if seen[s.id] {
			c.DuplicateStarts++
		}
		seen[s.id] = true
	}
	return c
}

// mostInSecond returns the most handler starts (local clock) and turns
// (Redis clock; -1 if no start had one) of subject in any 1 s window,
// over the starts from from on (zero: all).
func mostInSecond(starts []taskStart, subject string, from time.Time) (startsMax, turnsMax int) {
	var at, turns []int64
	for _, s := range starts {
		if (subject != "" && s.subject != subject) || s.at.Before(from) {
			continue
		}
		at = append(at, s.at.UnixNano())
		if !s.turn.IsZero() {
			turns = append(turns, s.turn.UnixNano())
		}
	}
	slices.Sort(at)
	slices.Sort(turns)
	turnsMax = -1
	if len(turns) > 0 {
		turnsMax = maxInWindow(turns, int64(time.Second))
	}
	return maxInWindow(at, int64(time.Second)), turnsMax
}

// scriptCount counts a client's script calls (EVALSHA, EVAL).
type scriptCount struct{ n *atomic.Int64 }

func (scriptCount) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c scriptCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd.Name()) {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c scriptCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if isScript(cmd.Name()) {
				c.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

func isScript(name string) bool {
	switch strings.ToLower(name) {
	case "evalsha", "eval", "evalsha_ro", "eval_ro":
		return true
	}
	return false
}
