package worker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// scrape gathers reg once and returns its samples of each metric name,
// by their labels written as name=value pairs joined by commas.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]map[string]float64{}
	for _, f := range families {
		byLabels := map[string]float64{}
		for _, m := range f.GetMetric() {
			byLabels[labelString(m)] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
		out[f.GetName()] = byLabels
	}
	return out
}

func labelString(m *dto.Metric) string {
	var parts []string
	for _, lp := range m.GetLabel() {
		parts = append(parts, lp.GetName()+"="+lp.GetValue())
	}
	return strings.Join(parts, ",")
}

// queuesInEveryState fills the bed's Redis: in q1, run by a server, a
// task completed (kept), one failed (waiting an hour for its retry) and
// one running until the test ends; in q2, run by nobody, 3 pending, 2
// scheduled and 1 archived; and 2 members in the wake-up ledger.
func queuesInEveryState(t *testing.T, b *bed) {
	t.Helper()
	ctx := context.Background()
	release := make(chan struct{})
	srv := asynq.NewServerFromRedisClient(b.rdb, asynq.Config{
		Concurrency:    2,
		Queues:         map[string]int{"q1": 1},
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour },
		LogLevel:       asynq.FatalLevel,
	})
	err := srv.Start(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		switch task.Type() {
		case "fail":
			return errors.New("failed")
		case "block":
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	t.Cleanup(func() { close(release) }) // first: Shutdown waits for the running task
	for _, typ := range []string{"ok", "fail", "block"} {
		if _, err := b.client.Enqueue(asynq.NewTask(typ, nil), asynq.Queue("q1"), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		if _, err := b.client.Enqueue(asynq.NewTask("x", nil), asynq.Queue("q2")); err != nil {
			t.Fatal(err)
		}
	}
	archived, err := b.client.Enqueue(asynq.NewTask("x", nil), asynq.Queue("q2"))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.insp.ArchiveTask("q2", archived.ID); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := b.client.Enqueue(asynq.NewTask("x", nil), asynq.Queue("q2"), asynq.ProcessIn(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	// One wake-up in each shard of the default ledger, which the
	// collector counts over every shard.
	ledger, _ := admission.NewShardedWakeups(b.rdb, admission.WakeupsKey, 0)
	for i, k := range ledger.Keys() {
		if err := b.rdb.ZAdd(ctx, k, redis.Z{Score: float64(i + 1), Member: fmt.Sprint("m", i)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, "q1's tasks completed, retrying and running", func() bool {
		info, err := b.insp.GetQueueInfo("q1")
		return err == nil && info.Completed == 1 && info.Retry == 1 && info.Active == 1
	})
}

// The queue gauges agree with asynq's Inspector on a real Redis, for
// tasks in every state, in a queue that a server runs and in one it does
// not; a queue that never held a task reports zeros; the ledger's size is
// the wake-up ledger's, over its shards. A scrape costs 1 + 3 × queues +
// shards Redis calls.
func TestQueueCollectorAgreesWithInspector(t *testing.T) {
	t.Parallel()
	b := newBed(t)
	queuesInEveryState(t, b)

	rdb := b.proc.Client(t) // the collector's own, to count its calls
	calls := redistest.CountCommands(rdb, nil)
	c, err := NewQueueCollector(rdb, []string{"q2", "q1", "never", "q1"})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	scraped := scrape(t, reg)
	got := scraped["jobthrottle_queue_tasks"]
	want := map[string]float64{}
	for _, q := range []string{"q1", "q2", "never"} {
		info := &asynq.QueueInfo{}
		if q != "never" {
			if info, err = b.insp.GetQueueInfo(q); err != nil {
				t.Fatal(err)
			}
		}
		for state, n := range map[string]int{"pending": info.Pending, "active": info.Active, "scheduled": info.Scheduled,
			"retry": info.Retry, "archived": info.Archived, "completed": info.Completed} {
			want["queue="+q+",state="+state] = float64(n)
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d queue samples %v; want %d", len(got), got, len(want))
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("jobthrottle_queue_tasks{%s} = %v, want %v (the Inspector's)", k, got[k], v)
		}
	}
	if got["queue=q2,state=pending"] != 3 || got["queue=q2,state=scheduled"] != 2 || got["queue=q2,state=archived"] != 1 {
		t.Errorf("q2: %v; want 3 pending, 2 scheduled, 1 archived", got)
	}
	if n := scraped["jobthrottle_wakeup_ledger_members"][""]; n != admission.DefaultWakeupShards {
		t.Errorf("jobthrottle_wakeup_ledger_members = %v, want %d (one in each shard)", n, admission.DefaultWakeupShards)
	}

	// Scripts are loaded by now: one scrape is SMEMBERS, and per queue
	// that exists (q1, q2) SISMEMBER and two EVALSHA, then a ZCARD per
	// shard.
	calls.ByName(true)
	if _, err := reg.Gather(); err != nil {
		t.Fatal(err)
	}
	if got, want := calls.ByName(false), map[string]int{"smembers": 1, "sismember": 2, "evalsha": 4, "zcard": admission.DefaultWakeupShards}; !equalCounts(got, want) {
		t.Errorf("one scrape sent %v; want %v", got, want)
	}
	if n, ok := scraped["jobthrottle_queue_read_errors_total"][""]; !ok || n != 0 {
		t.Errorf("read errors = %v (exported: %v), want 0", n, ok)
	}
}

func equalCounts(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// A Redis that does not answer holds a scrape up for QueueReadTimeout at
// most: the scrape has no queue metrics and counts an error, and one
// while that read is still under way counts an error at once instead of
// starting another read.
func TestQueueCollectorTimeout(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn // never answered
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
		}
	}()
	rdb := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), ReadTimeout: time.Minute, Protocol: 2, DisableIdentity: true})
	t.Cleanup(func() { rdb.Close() })
	c, err := NewQueueCollector(rdb, []string{"default"})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	start := time.Now()
	for i := range 2 {
		scraped := scrape(t, reg)
		if got := scraped["jobthrottle_queue_tasks"]; len(got) != 0 {
			t.Errorf("scrape %d: queue samples %v from a Redis that does not answer", i+1, got)
		}
		if n := scraped["jobthrottle_queue_read_errors_total"][""]; n != float64(i+1) {
			t.Errorf("after scrape %d: read errors = %v, want %d", i+1, n, i+1)
		}
	}
	if d := time.Since(start); d > QueueReadTimeout+10*time.Second {
		t.Errorf("two scrapes took %v; want about QueueReadTimeout, %v", d, QueueReadTimeout)
	}
}
