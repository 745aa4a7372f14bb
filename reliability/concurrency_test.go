package reliability

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

const roleConcWorker = "concurrency-worker"

// The concurrency fleet's settings: at most 3 tasks at once, a lease of 2s
// (renewed every 667ms), each task 300ms.
const (
	concPlaces = 3
	concLease  = 2 * time.Second
	concWork   = 300 * time.Millisecond
)

// runConcWorker is one worker process of TestConcurrencyWorkerKilled: an
// asynq server of concurrency 5 behind the middleware with one concurrency
// rule, whose handler records its start and end (pid, task, Unix ns) in the
// list <prefix>events. It runs until killed.
func runConcWorker(addr, prefix string) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix, Logger: log, OnHandoff: worker.WakeOnHandoff(rdb)},
		throttle.Rule{Name: "running", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: concPlaces, Period: concLease}})
	if err != nil {
		panic(err)
	}
	mw, err := worker.NewMiddleware([]worker.TaskRule{{Name: "running", Tasks: []string{"job:*"}, Limiter: lim, Subject: worker.Fixed("all")}},
		worker.Options{Asynq: rdb, Logger: log})
	if err != nil {
		panic(err)
	}
	events := prefix + "events"
	record := func(what, id string) {
		rdb.RPush(context.Background(), events, fmt.Sprintf("%s %d %s %d", what, os.Getpid(), id, time.Now().UnixNano()))
	}
	mux := asynq.NewServeMux()
	// Outside the throttle: which process holds each task, running or
	// waiting for a place; a task the killed worker held waits for
	// asynq's recovery whether or not its handler had started.
	mux.Use(func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			id, _ := asynq.GetTaskID(ctx)
			record("got", id)
			defer record("left", id)
			return next.ProcessTask(ctx, task)
		})
	})
	mux.Use(mw.Wrap)
	mux.HandleFunc("job:", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		record("start", id)
		time.Sleep(concWork)
		record("end", id)
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{Concurrency: 5, LogLevel: asynq.FatalLevel}))
	if err := srv.Start(mux); err != nil {
		panic(err)
	}
	fmt.Println("READY")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	srv.Shutdown()
	mw.Drain()
}

// concEvent is one handler start or end, or (held set) a task reaching
// or leaving the worker's middleware chain.
type concEvent struct {
	start bool
	held  bool
	pid   int
	task  string
	at    time.Time
}

func readConcEvents(t *testing.T, rdb *redis.Client, prefix string) (evs, holds []concEvent) {
	t.Helper()
	raw, err := rdb.LRange(context.Background(), prefix+"events", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range raw {
		f := strings.Fields(r)
		pid, _ := strconv.Atoi(f[1])
		ns, _ := strconv.ParseInt(f[3], 10, 64)
		e := concEvent{start: f[0] == "start" || f[0] == "got", held: f[0] == "got" || f[0] == "left", pid: pid, task: f[2], at: time.Unix(0, ns)}
		if e.held {
			holds = append(holds, e)
		} else {
			evs = append(evs, e)
		}
	}
	byTime := func(a, b concEvent) int { return a.at.Compare(b.at) }
	slices.SortFunc(evs, byTime)
	slices.SortFunc(holds, byTime)
	return evs, holds
}

// heldBy counts the tasks whose last hold event is pid's "got": those it
// had when it died, running or waiting for a place.
func heldBy(holds []concEvent, pid int) int {
	last := map[string]concEvent{}
	for _, e := range holds {
		last[e.task] = e
	}
	n := 0
	for _, e := range last {
		if e.start && e.pid == pid {
			n++
		}
	}
	return n
}

// TestConcurrencyWorkerKilled: three worker processes share a concurrency
// limit of 3 (lease 2s) over 60 tasks of 300ms of one subject. One worker
// is killed with SIGKILL while it runs a task. Measured from the handlers:
// never more than 3 tasks run at once (the killed one's counted as running
// until its lease could first have expired); the dead worker's places free
// within the lease (plus the wake-up and asynq's pick-up: 1s), not before,
// after which the two others run 3 at once; and every task the dead
// worker did not hold (running, or waiting in its middleware for a place)
// completes once, long before asynq would re-run the held ones (its own
// lease, 30s).
func TestConcurrencyWorkerKilled(t *testing.T) {
	if child() == roleConcWorker {
		runConcWorker(os.Getenv("JT_REDIS_ADDR"), os.Getenv("JT_PREFIX"))
		return
	}
	if child() != "" {
		t.Skip("child process of another test")
	}
	t.Parallel()
	srv := redistest.Server(t)
	rdb := srv.Client(t)
	prefix := redistest.Prefix(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var pids []int
	var outs []*syncBuffer
	for range 3 {
		cmd, out := childCommand(t, ctx, "TestConcurrencyWorkerKilled", roleConcWorker, "JT_REDIS_ADDR="+srv.Addr(), "JT_PREFIX="+prefix)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		pids = append(pids, cmd.Process.Pid)
		outs = append(outs, out)
	}
	for i, out := range outs {
		for deadline := time.Now().Add(30 * time.Second); !strings.Contains(out.String(), "READY"); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("worker %d not ready:\n%s", i, out)
			}
		}
	}

	const n = 60
	client := asynq.NewClientFromRedisClient(rdb)
	for range n {
		if _, err := client.Enqueue(asynq.NewTask("job:run", nil), asynq.Retention(time.Hour), asynq.MaxRetry(3)); err != nil {
			t.Fatal(err)
		}
	}
	// Kill the first worker seen running a task, 1.5s in.
	time.Sleep(1500 * time.Millisecond)
	var victim int
	var killed time.Time
	for deadline := time.Now().Add(10 * time.Second); victim == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no worker ran a task")
		}
		open := map[string]int{}
		evs, _ := readConcEvents(t, rdb, prefix)
		for _, e := range evs {
			if e.start {
				open[e.task] = e.pid
			} else {
				delete(open, e.task)
			}
		}
		for _, pid := range open {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			victim, killed = pid, time.Now()
			break
		}
	}
	orphans, held := 0, 0
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for deadline := time.Now().Add(40 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		evs, holds := readConcEvents(t, rdb, prefix)
		held = heldBy(holds, victim)
		ended := map[string]bool{}
		for _, e := range evs {
			if !e.start {
				ended[e.task] = true
			}
		}
		orphans = 0
		for _, e := range evs {
			if e.start && e.pid == victim && !ended[e.task] {
				orphans++
			}
		}
		q, err := insp.GetQueueInfo("default")
		if err == nil && q.Completed+held >= n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%+v: %d killed mid-task, %d held by the killed worker, of %d within 40s", q, orphans, held, n)
		}
	}

	// Replay the events: running tasks at each instant; the killed
	// worker's open tasks count as running until their leases could first
	// have expired: renewed every third of the lease, the last renewal was
	// at most a third of a lease before the kill.
	const earliestExpiry = concLease*2/3 - 50*time.Millisecond // less the renewal ticker's jitter
	evs, _ := readConcEvents(t, rdb, prefix)
	ended := map[string]bool{}
	for _, e := range evs {
		if !e.start {
			ended[e.task] = true
		}
	}
	for _, e := range evs {
		if e.start && e.pid == victim && !ended[e.task] {
			evs = append(evs, concEvent{pid: victim, task: e.task, at: killed.Add(earliestExpiry)})
		}
	}
	slices.SortFunc(evs, func(a, b concEvent) int {
		if c := a.at.Compare(b.at); c != 0 {
			return c
		}
		if a.start == b.start {
			return 0
		}
		if a.start {
			return 1 // ends first at one instant
		}
		return -1
	})
	running, most, live := 0, 0, 0
	var full time.Time // first instant after the kill with places live tasks running
	runs := map[string]int{}
	for _, e := range evs {
		d := -1
		if e.start {
			d = 1
			runs[e.task]++
		}
		running += d
		most = max(most, running)
		if e.pid != victim {
			live += d
		}
		if e.start && e.pid != victim && e.at.After(killed) && live >= concPlaces && full.IsZero() {
			full = e.at
		}
	}
	if most > concPlaces {
		t.Errorf("%d tasks ran at once, want at most %d", most, concPlaces)
	}
	for task, k := range runs {
		if k != 1 {
			t.Errorf("task %s started %d times, want once", task, k)
		}
	}
	if full.IsZero() {
		t.Fatalf("the two live workers never ran %d tasks at once after the kill", concPlaces)
	}
	freed := full.Sub(killed)
	t.Logf("killed worker %d mid-task (%d of its tasks running, %d held); the others ran %d at once %v later (lease %v); at most %d at once in all; %d tasks completed",
		victim, orphans, held, concPlaces, freed.Round(time.Millisecond), concLease, most, n-held)
	if freed > concLease+time.Second {
		t.Errorf("full concurrency came back %v after the kill, want within the lease %v + 1s", freed, concLease)
	}
	if freed < earliestExpiry {
		t.Errorf("full concurrency came back %v after the kill, before the dead worker's leases could expire (%v)", freed, earliestExpiry)
	}
}
