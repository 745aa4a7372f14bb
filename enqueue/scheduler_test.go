package enqueue

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// safeBuffer is a log sink for concurrent writers.
type safeBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A schedule firing every second whose paced batch takes 2.5 s to arrive:
// with overlap skip, the two firings during a batch are dropped and
// logged; with delay, they wait and run after it, so batches never pile
// up on each other.
func TestSchedulerOverlap(t *testing.T) {
	for _, c := range []struct {
		overlap string
		batches int
		logged  string
	}{
		// Firings at 1s (batch to 3.45s), 2s, 3s skipped, 4s (batch), 5s, 6s skipped, 7s (batch).
		{"skip", 3, "firing skipped"},
		// Firings at 1s, then 2s delayed to 3.45s, then 3s delayed …: each
		// batch starts when the previous one has arrived.
		{"delay", 3, "firing delayed"},
	} {
		t.Run(c.overlap, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client) {
				file := "schedules:\n  - name: tick\n    cron: \"* * * * * *\"\n    type: t\n    count: 10\n    overlap: " + c.overlap +
					"\n    pace: {rule: api, rate: 4/s, subject: {fixed: s}}\n"
				s, err := ParseSchedules("s.yaml", []byte(file))
				if err != nil {
					t.Fatal(err)
				}
				client := &fakeClient{}
				logs := &safeBuffer{}
				var mu sync.Mutex
				var batches []time.Time
				start := time.Now()
				sch, err := NewScheduler(s, SchedulerOptions{
					Redis: rdb, Client: client, Logger: slog.New(slog.NewTextHandler(logs, nil)),
					OnBatch: func(name string, res Summary, err error) {
						if name != "tick" || err != nil || res.Enqueued != 10 {
							t.Errorf("OnBatch(%q, %+v, %v)", name, res, err)
						}
						mu.Lock()
						batches = append(batches, time.Now())
						mu.Unlock()
					},
				})
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 7500*time.Millisecond)
				defer cancel()
				if err := sch.Run(ctx); err != nil {
					t.Fatal(err)
				}
				mu.Lock()
				defer mu.Unlock()
				if len(batches) != c.batches {
					t.Errorf("%d batches at %v, want %d", len(batches), offsets(start, batches), c.batches)
				}
				// No batch starts before the previous one has arrived
				// (10 tasks at 4/s: 2.25 s after it started).
				for i := 1; i < len(batches); i++ {
					if gap := batches[i].Sub(batches[i-1]); gap < 2250*time.Millisecond {
						t.Errorf("batches at %v: %v apart, overlapping", offsets(start, batches), gap)
					}
				}
				// Every task was booked after the previous one.
				for i := 1; i < len(client.tasks); i++ {
					if !client.tasks[i].processAt.After(client.tasks[i-1].processAt) {
						t.Errorf("task %d due at %v, not after task %d", i, client.tasks[i].processAt, i-1)
					}
				}
				if !strings.Contains(logs.String(), c.logged) {
					t.Errorf("logs do not say %q:\n%s", c.logged, logs)
				}
			})
		})
	}
}

func offsets(start time.Time, ts []time.Time) []time.Duration {
	var out []time.Duration
	for _, t := range ts {
		out = append(out, t.Sub(start))
	}
	return out
}

// Stopping the scheduler stops a batch between two tasks and returns.
func TestSchedulerStopsMidBatch(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		s, err := ParseSchedules("s.yaml", []byte("schedules:\n  - {name: big, cron: \"@every 1s\", type: t, count: 1000000}\n"))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		client := &fakeClient{fail: func(i int) error {
			if i == 100 {
				cancel()
			}
			return nil
		}}
		var got Summary
		sch, err := NewScheduler(s, SchedulerOptions{Client: client, Logger: slog.New(slog.DiscardHandler),
			OnBatch: func(_ string, res Summary, err error) { got = res }})
		if err != nil {
			t.Fatal(err)
		}
		if err := sch.Run(ctx); err != nil {
			t.Fatal(err)
		}
		if got.Enqueued != 101 {
			t.Errorf("enqueued %d, want 101 (stopped right after cancel)", got.Enqueued)
		}
	})
}

func TestNewSchedulerErrors(t *testing.T) {
	paced, err := ParseSchedules("s.yaml", []byte("rules: r.yaml\nschedules:\n  - {name: p, cron: \"@hourly\", type: t, count: 1, pace: {}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewScheduler(paced, SchedulerOptions{}); err == nil {
		t.Error("nil client accepted")
	}
	if _, err := NewScheduler(paced, SchedulerOptions{Client: &fakeClient{}}); err == nil {
		t.Error("paced schedule without Redis accepted")
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	if _, err := NewScheduler(paced, SchedulerOptions{Client: &fakeClient{}, Redis: rdb}); err == nil || !strings.Contains(err.Error(), "LoadSchedules") {
		t.Errorf("rules file not loaded: %v, want a hint to LoadSchedules", err)
	}
}
