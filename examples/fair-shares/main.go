// Fair shares: one API key, one limit, shared by every tenant. A tenant
// that enqueues 20 tasks behind another's 300 runs at its share of the key
// from its first task instead of waiting for the 300 to drain: the rule's
// fair_by takes the tasks waiting for the key in turn per tenant, by
// weight. Run it with
//
//	go run ./examples/fair-shares
//
// No Redis is needed: it starts an in-memory one on loopback. It runs for
// about five seconds.
//
// It uses rules and worker (admission for each task's turn), and
// internal/devredis; as a program, nothing imports it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// rulesFile is the rules file the workers load, as cmd/worker would: one
// API key (the subject is fixed) at Rate per second, its turns shared by
// the payload's tenant, small-b weighing two.
const rulesFile = `prefix: "fair-shares:"
rules:
  - name: partner-api
    tasks: ["partner:*"]
    subject: {fixed: key-1}            # what is limited: the one API key
    fair_by: {payload_field: tenant}   # who shares it
    weights: {small-b: 2}              # two turns for one of the others
    algorithm: gcra
    limit: %d
    period: 1s
    burst: 1
`

// config is one run.
type config struct {
	Rate        int           // the key's limit, per second
	Big         int           // tasks big enqueues first
	Small       int           // tasks each small tenant enqueues then
	Join        time.Duration // the small tenants enqueue this long after big, once big's tasks have all parked
	Linger      time.Duration // how long the run goes on once the small tenants are done
	Servers     int           // asynq worker servers (processes, in real life)
	Concurrency int           // each server's worker slots
}

var defaults = config{Rate: 20, Big: 300, Small: 20, Join: time.Second, Linger: time.Second, Servers: 2, Concurrency: 10}

// The tenants, in the order they enqueue, with their weights in rulesFile.
const big = "big"

var (
	smalls  = []string{"small-a", "small-b"}
	weights = map[string]int{big: 1, "small-a": 1, "small-b": 2}
)

// tenantResult is what one tenant's tasks did; times are since big's first
// task was enqueued.
type tenantResult struct {
	Tenant      string
	Weight      int
	Tasks       int           // enqueued
	Started     int           // handlers started
	First, Last time.Duration // the first and last handler start
	Rate        float64       // handler starts per second between First and Last
	Window      int           // handler starts while the small tenants ran (summary.Joined to summary.SmallsDone)
}

// summary is what a run measured.
type summary struct {
	Tenants    []tenantResult    // big, then the small tenants
	Joined     time.Duration     // when the small tenants enqueued
	BigWaiting int               // big's tasks not yet started then
	SmallsDone time.Duration     // the last small task's start
	Turns      []time.Time       // every start's turn of the key, on the Redis clock
	Enqueued   map[string]string // tenant by task ID
	Starts     map[string]int    // handler starts by task ID
	Errors     []error           // handler errors other than parking or draining at shutdown
}

func main() {
	log.SetFlags(0)
	cfg := defaults
	fmt.Printf("jobthrottle fair-shares: one API key at %d/s (gcra, burst 1) shared by every tenant; fair_by: tenant, small-b weighs 2.\n", cfg.Rate)
	fmt.Printf("big enqueues %d tasks; a second later, once they are parked, small-a and small-b enqueue %d each. %d workers, %d slots each.\n\n",
		cfg.Big, cfg.Small, cfg.Servers, cfg.Concurrency)
	s, err := run(context.Background(), cfg, os.Stdout)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("tenant   weight  tasks  started  first start  last start  rate while it ran")
	for _, r := range s.Tenants {
		fmt.Printf("%-8s %6d %6d %8d %11.1fs %10.1fs %14.1f/s\n", r.Tenant, r.Weight, r.Tasks, r.Started, r.First.Seconds(), r.Last.Seconds(), r.Rate)
	}
	window := s.SmallsDone - s.Joined
	total := 0
	for _, r := range s.Tenants {
		total += r.Window
	}
	fmt.Printf("\nFrom %.1fs, when the small tenants enqueued, to %.1fs, their last start, the key ran %d tasks (%.1f/s):",
		s.Joined.Seconds(), s.SmallsDone.Seconds(), total, float64(total)/window.Seconds())
	for i, r := range s.Tenants {
		sep := ","
		if i == 0 {
			sep = ""
		}
		fmt.Printf("%s %s %d", sep, r.Tenant, r.Window)
	}
	fmt.Println(".")
	wait := float64(s.BigWaiting) / float64(cfg.Rate)
	fmt.Printf("First come, first served, they would have waited behind big's %d tasks still queued: %d / %d/s = %.1fs before\n",
		s.BigWaiting, s.BigWaiting, cfg.Rate, wait)
	fmt.Printf("their first task, and %.1fs for their last; with fair_by the last ran %.1fs after they enqueued.\n",
		wait+float64(len(smalls)*cfg.Small)/float64(cfg.Rate), window.Seconds())
	left := cfg.Big - s.Tenants[0].Started
	fmt.Printf("Stopped there: big's other %d tasks were not drained (the workers were shut down; at %d/s they need %.0fs more).\n",
		left, cfg.Rate, float64(left)/float64(cfg.Rate))
}

// run starts the workers, enqueues big's tasks and then the small
// tenants', and returns once the small tenants' tasks have all started
// and cfg.Linger has passed, with the workers shut down.
func run(ctx context.Context, cfg config, out io.Writer) (summary, error) {
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		return summary{}, err
	}
	defer dev.Close()
	rc, err := rules.Parse("rules.yaml", fmt.Appendf(nil, rulesFile, cfg.Rate))
	if err != nil {
		return summary{}, err
	}

	type start struct {
		id, tenant string
		at         time.Time
		turn       time.Time
	}
	var (
		mu     sync.Mutex
		starts []start
		parks  int
		errs   []error
	)
	var stops []func()
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	for range cfg.Servers {
		rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
		defer rdb.Close()
		// Asynq: the wake-up loop serves the key's line, where fair_by
		// takes the tenants in turn.
		mw, err := worker.FromRules(rc, rdb, worker.Options{Asynq: rdb, Logger: quietLogger()})
		if err != nil {
			return summary{}, err
		}
		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		mux.HandleFunc("partner:call", func(ctx context.Context, t *asynq.Task) error {
			var p struct{ Tenant string }
			if err := json.Unmarshal(t.Payload(), &p); err != nil {
				return err
			}
			id, _ := asynq.GetTaskID(ctx)
			w, _ := admission.WaitedFrom(ctx)
			mu.Lock()
			defer mu.Unlock()
			starts = append(starts, start{id: id, tenant: p.Tenant, at: time.Now(), turn: w.Turn})
			return nil
		})
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
			Concurrency: cfg.Concurrency,
			LogLevel:    asynq.ErrorLevel,
			ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
				mu.Lock()
				defer mu.Unlock()
				switch {
				case errors.Is(err, worker.ErrParked):
					parks++
				case errors.Is(err, worker.ErrDraining): // deferred at shutdown
				default:
					errs = append(errs, err)
				}
			}),
		}))
		if err := srv.Start(mux); err != nil {
			mw.Drain()
			return summary{}, err
		}
		// Stop takes no new tasks, Drain defers those waiting for a turn,
		// so Shutdown waits only for running handlers.
		stops = append(stops, func() { srv.Stop(); mw.Drain(); srv.Shutdown() })
	}

	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	enqueued := map[string]string{}
	enqueue := func(tenant string, n int) error {
		for i := range n {
			payload := fmt.Appendf(nil, `{"tenant": %q, "n": %d}`, tenant, i)
			info, err := client.EnqueueContext(ctx, asynq.NewTask("partner:call", payload))
			if err != nil {
				return err
			}
			enqueued[info.ID] = tenant
		}
		return nil
	}

	t0 := time.Now()
	if err := enqueue(big, cfg.Big); err != nil {
		return summary{}, err
	}
	// Until every task of big's has been through a worker once (it ran, or
	// it parked on a booked turn or in the key's line), and cfg.Join has
	// passed: big runs alone for a while.
	for end := t0.Add(cfg.Join + 10*time.Second); time.Now().Before(end); {
		mu.Lock()
		seen := parks + len(starts)
		mu.Unlock()
		if seen >= cfg.Big && time.Since(t0) >= cfg.Join {
			break
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return summary{}, err
		}
	}
	joined := time.Since(t0)
	mu.Lock()
	bigWaiting := cfg.Big - len(starts)
	mu.Unlock()
	fmt.Fprintf(out, "  %4.1fs: big's tasks parked, %d of them still waiting; small-a and small-b enqueue\n\n", joined.Seconds(), bigWaiting)
	for _, tenant := range smalls {
		if err := enqueue(tenant, cfg.Small); err != nil {
			return summary{}, err
		}
	}

	// Until every small task has started: first come, first served that
	// takes big's backlog at the key's rate and then some.
	timeout := time.Now().Add(joined + time.Duration(cfg.Big+len(smalls)*cfg.Small)*time.Second/time.Duration(cfg.Rate) + 30*time.Second)
	for {
		mu.Lock()
		n := 0
		for _, s := range starts {
			if s.tenant != big {
				n++
			}
		}
		mu.Unlock()
		if n >= len(smalls)*cfg.Small {
			break
		}
		if time.Now().After(timeout) {
			return summary{}, fmt.Errorf("fair-shares: %d of the small tenants' %d tasks started in time", n, len(smalls)*cfg.Small)
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return summary{}, err
		}
	}
	if err := sleep(ctx, cfg.Linger); err != nil {
		return summary{}, err
	}
	for _, stop := range stops {
		stop()
	}
	stops = nil

	mu.Lock()
	defer mu.Unlock()
	s := summary{Joined: joined, BigWaiting: bigWaiting, Enqueued: enqueued, Starts: map[string]int{}, Errors: errs}
	for _, st := range starts {
		if st.tenant != big {
			s.SmallsDone = max(s.SmallsDone, st.at.Sub(t0))
		}
	}
	for _, tenant := range append([]string{big}, smalls...) {
		r := tenantResult{Tenant: tenant, Weight: weights[tenant], Tasks: cfg.Small}
		if tenant == big {
			r.Tasks = cfg.Big
		}
		var at []time.Duration
		for _, st := range starts {
			if st.tenant == tenant {
				at = append(at, st.at.Sub(t0))
			}
		}
		slices.Sort(at)
		if r.Started = len(at); r.Started > 0 {
			r.First, r.Last = at[0], at[len(at)-1]
		}
		if r.Last > r.First {
			r.Rate = float64(r.Started-1) / (r.Last - r.First).Seconds()
		}
		for _, a := range at {
			if a >= joined && a <= s.SmallsDone {
				r.Window++
			}
		}
		s.Tenants = append(s.Tenants, r)
	}
	for _, st := range starts {
		s.Starts[st.id]++
		s.Turns = append(s.Turns, st.turn)
	}
	return s, nil
}

// sleep waits d, or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// quietLogger hides the middleware's debug and info lines.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
