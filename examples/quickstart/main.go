// Quickstart: three asynq worker servers share one limit of 10 tasks per
// second through Redis. Run it with
//
//	go run ./examples/quickstart
//
// No Redis is needed: it starts an in-memory one on loopback.
//
// It uses throttle and worker, and internal/devredis; as a program, nothing imports it.
package main

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

const (
	servers     = 3
	concurrency = 10
	tasks       = 60
	perSecond   = 10
)

// run is one task's run: which server, when.
type run struct {
	server string
	at     time.Time
}

func main() {
	log.SetFlags(0)
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer dev.Close()
	fmt.Printf("jobthrottle quickstart: %d asynq worker servers share one limit of %d tasks/s, kept in Redis.\n", servers, perSecond)
	fmt.Printf("Redis: an in-memory one at %s (pass your own to the real worker: see worker/README.md)\n\n", dev.URL())

	var mu sync.Mutex
	var runs []run
	done := make(chan struct{})

	// Each server is what a separate worker process would be: its own
	// Redis connection, its own limiter object, the same rule and keys.
	var srvs []*asynq.Server
	for i := range servers {
		name := string(rune('A' + i))
		rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
		defer rdb.Close()
		lim, err := throttle.New(rdb, throttle.Options{Prefix: "quickstart:"},
			throttle.Rule{Name: "partner-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(perSecond).WithBurst(1)})
		if err != nil {
			log.Fatal(err)
		}
		mw, err := worker.NewMiddleware([]worker.TaskRule{{
			Name:    "partner-api",
			Tasks:   []string{"report:*"},
			Limiter: lim,
			Subject: worker.Fixed("partner-api"), // one limit shared by every task
			// Wait in the worker up to 1s, else park until the booked turn.
			Settings: admission.Settings{MaxWait: time.Second},
		}}, worker.Options{Logger: quietLogger(), Asynq: rdb}) // Asynq: parked tasks are woken on time
		if err != nil {
			log.Fatal(err)
		}
		defer mw.Drain()
		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		mux.HandleFunc("report:build", func(ctx context.Context, t *asynq.Task) error {
			mu.Lock()
			defer mu.Unlock()
			runs = append(runs, run{server: name, at: time.Now()})
			if len(runs) == tasks {
				close(done)
			}
			return nil
		})
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
			Concurrency:       concurrency,
			TaskCheckInterval: 100 * time.Millisecond,
			LogLevel:          asynq.ErrorLevel,
		}))
		if err := srv.Start(mux); err != nil {
			log.Fatal(err)
		}
		srvs = append(srvs, srv)
	}

	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range tasks {
		payload := fmt.Sprintf(`{"report": %d}`, i)
		if _, err := client.Enqueue(asynq.NewTask("report:build", []byte(payload)), asynq.Retention(time.Hour)); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Printf("Enqueued %d tasks at once; %d worker slots (%d servers × %d) compete for them.\n\n", tasks, servers*concurrency, servers, concurrency)

	select {
	case <-done:
	case <-time.After(60 * time.Second):
		log.Fatal("quickstart: the tasks did not finish within 60s")
	}
	for _, srv := range srvs {
		srv.Stop()
	}

	mu.Lock()
	first, last := runs[0].at, runs[len(runs)-1].at
	// Seconds counted from half a slot before the first start: slots are
	// 100ms apart, so a start woken a little late stays in its second.
	origin := first.Add(-time.Second / perSecond / 2)
	bySecond := map[int]map[string]int{}
	for _, r := range runs {
		s := int(r.at.Sub(origin) / time.Second)
		if bySecond[s] == nil {
			bySecond[s] = map[string]int{}
		}
		bySecond[s][r.server]++
	}
	mu.Unlock()

	fmt.Println("second  tasks  by server")
	busiest := 0
	for s := 0; s < len(bySecond); s++ {
		n, by := 0, []string{}
		for i := range servers {
			name := string(rune('A' + i))
			n += bySecond[s][name]
			by = append(by, fmt.Sprintf("%s %2d", name, bySecond[s][name]))
		}
		busiest = max(busiest, n)
		fmt.Printf("%4d  %5d   %s  %s\n", s+1, n, strings.Join(by, "  "), strings.Repeat("#", n))
	}

	insp := asynq.NewInspectorFromRedisClient(rdb)
	q, err := insp.GetQueueInfo("default")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("\nAll %d tasks done in %.1fs from the first start; at most %d in any second (limit %d/s).\n", len(runs), last.Sub(first).Seconds(), busiest, perSecond)
	fmt.Printf("asynq inspector: %d completed, %d failed, %d archived.\n", q.Completed, q.FailedTotal, q.Archived)
	for _, srv := range srvs {
		srv.Shutdown()
	}
	if q.FailedTotal != 0 || q.Archived != 0 || q.Completed != tasks {
		os.Exit(1)
	}
}

// quietLogger hides the middleware's debug and info lines, so the tally
// stands out.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
