// Command batch-cron shows cmd/enqueue's schedules: a cron schedule that
// enqueues a batch every 2 seconds, paced in the workers' own Redis ledger,
// and an asynq worker that runs the tasks at their slots without charging
// them again. It runs for about ten seconds and exits.
//
//	go run ./examples/batch-cron
//
// It uses rules, enqueue, worker and admission (a producer and a worker in one program), and internal/devredis; as a program, nothing imports it.
package main

import (
	"context"
	_ "embed"
	"fmt"
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/enqueue"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

var (
	//go:embed rules.yaml
	rulesYAML []byte
	//go:embed schedules.yaml
	schedulesYAML []byte
)

// runFor is how long the schedules run.
const runFor = 7 * time.Second

type ran struct {
	id       string
	at       time.Time
	late     time.Duration // start minus slot, filled in by report
	waited   time.Duration // in the middleware
	redeemed bool
}

func main() {
	log.SetFlags(0)
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()
	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()

	// The two files, as cmd/worker and cmd/enqueue would read them.
	dir, err := os.MkdirTemp("", "batch-cron")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	for name, data := range map[string][]byte{"rules.yaml": rulesYAML, "schedules.yaml": schedulesYAML} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			log.Fatal(err)
		}
	}
	cfg, err := rules.Load(filepath.Join(dir, "rules.yaml"))
	if err != nil {
		log.Fatal(err)
	}
	schedules, err := enqueue.LoadSchedules(filepath.Join(dir, "schedules.yaml"))
	if err != nil {
		log.Fatal(err)
	}

	// The worker: asynq with the throttle middleware of the rules file.
	var mu sync.Mutex
	var runs []ran
	slots := map[string]time.Time{} // task ID → slot
	mw, err := worker.FromRules(cfg, rdb, worker.Options{Logger: slog.New(slog.DiscardHandler), Asynq: rdb})
	if err != nil {
		log.Fatal(err)
	}
	defer mw.Drain()
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("report:build", func(ctx context.Context, t *asynq.Task) error {
		w, _ := admission.WaitedFrom(ctx)
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		runs = append(runs, ran{id: id, at: time.Now(), waited: w.Duration, redeemed: w.Redeemed})
		mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency: 30,
		// Paced tasks are scheduled for their slot, which asynq keeps in
		// whole seconds; move them to the queue promptly, and let the
		// middleware wait the rest of the second for the exact slot.
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		TaskCheckInterval:        50 * time.Millisecond,
		LogLevel:                 asynq.ErrorLevel,
	}))
	if err := srv.Start(mux); err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()

	// The enqueuer: enqueue schedule --config schedules.yaml.
	start := time.Now()
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.String("t", fmt.Sprintf("+%.2fs", time.Since(start).Seconds()))
			}
			return a
		},
	}))
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	var enqueued int
	sch, err := enqueue.NewScheduler(schedules, enqueue.SchedulerOptions{
		Redis: rdb, Client: client, Logger: logger,
		OnEnqueued: func(_ string, e enqueue.Enqueued) {
			mu.Lock()
			slots[e.ID] = e.Due
			mu.Unlock()
		},
		OnBatch: func(_ string, res enqueue.Summary, _ error) {
			mu.Lock()
			enqueued += res.Enqueued
			mu.Unlock()
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("schedule \"reports\": every 2s, 50 report:build tasks paced at 20/s under the workers' rule; running for %v\n\n", runFor)
	ctx, cancel := context.WithTimeout(context.Background(), runFor)
	defer cancel()
	if err := sch.Run(ctx); err != nil {
		log.Fatal(err)
	}

	// Let the last batch arrive.
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		done := len(runs) >= enqueued
		mu.Unlock()
		if done || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, r := range runs {
		runs[i].late = r.at.Sub(slots[r.id])
	}
	report(runs, enqueued)
}

// report prints how the tasks ran: how many, how close to their slots,
// how long the workers held them and whether any was charged twice.
func report(runs []ran, enqueued int) {
	var redeemed int
	var maxLate, maxWait time.Duration
	for _, r := range runs {
		if r.redeemed {
			redeemed++
		}
		maxLate = max(maxLate, r.late)
		maxWait = max(maxWait, r.waited)
	}
	fmt.Printf("\n%d of %d enqueued tasks ran, each at its slot (50ms apart) or at most %v after it\n", len(runs), enqueued, maxLate.Round(time.Millisecond))
	fmt.Printf("%d ran on their prepaid receipt: charged once, at enqueue time, never again by the worker\n", redeemed)
	fmt.Printf("the worker held a task at most %v before its slot (asynq schedules in whole seconds, and lead: 200ms)\n", maxWait.Round(time.Millisecond))
}
