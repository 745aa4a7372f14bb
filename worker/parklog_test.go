package worker

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// syncBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// lines returns the lines logged so far that contain all of want.
func (s *syncBuffer) lines(want ...string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for line := range strings.Lines(s.b.String()) {
		all := true
		for _, w := range want {
			all = all && strings.Contains(line, w)
		}
		if all {
			out = append(out, line)
		}
	}
	return out
}

// TestParkSummary: 100 parked tasks (asynq and miniredis on virtual
// time) log no Info line each, but one summary for their rule after
// ParkSummaryEvery, and nothing more while nothing parks.
func TestParkSummary(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := bedOn(t, rdb)
		var log syncBuffer
		// A horizon of 10m books every turn at once: each task parks once.
		cfg := parseRules(t, `prefix: "`+b.prefix+`"
rules:
  - {name: api, tasks: [api], subject: {fixed: all}, algorithm: gcra, limit: 1, period: 1s, max_wait: 1ms, horizon: 10m}
`)
		mw, err := FromRules(cfg, rdb, Options{Asynq: rdb, Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		srv := b.serve(mw, asynq.Config{})
		defer srv.Shutdown()
		start := time.Now()
		for range 101 {
			b.enqueue("api", "")
		}
		parks := func() int { return len(log.lines("level=DEBUG", `msg="worker: task parked until its turn"`)) }
		eventually(t, 5*time.Second, "100 tasks parked", func() bool { return parks() >= 100 })
		if got := log.lines("level=INFO"); len(got) != 0 {
			t.Errorf("Info lines before the summary is due:\n%s", strings.Join(got, ""))
		}

		time.Sleep(time.Until(start.Add(ParkSummaryEvery + time.Second)))
		summary := log.lines("level=INFO")
		if len(summary) != 1 {
			t.Fatalf("%d Info lines after %v, want one summary:\n%s", len(summary), ParkSummaryEvery, strings.Join(summary, ""))
		}
		if want := `msg="worker: tasks parked until their turns" rule=api parked=100 interval=10s furthest_turn=2000-01-01T00:01:40`; !strings.Contains(summary[0], want) || parks() != 100 {
			t.Errorf("summary %q after %d parks; want 100 and it to contain %q", summary[0], parks(), want)
		}

		// The tasks run on their turns; nothing parks: no more lines.
		time.Sleep(3 * ParkSummaryEvery)
		if got := log.lines("level=INFO"); len(got) != 1 {
			t.Errorf("%d Info lines after intervals without parks, want still the one summary:\n%s", len(got), strings.Join(got, ""))
		}
		if n := len(b.runs()); n < 30 {
			t.Errorf("%d tasks ran in %v at 1/s, want at least 30", n, time.Since(start))
		}
	})
}

// TestParkSummaryAtDrain: Drain logs the parks counted so far at once,
// and once.
func TestParkSummaryAtDrain(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var log syncBuffer
		p := &parkTally{log: slog.New(slog.NewTextHandler(&log, nil)), every: ParkSummaryEvery}
		turn := time.Now().Add(3 * time.Second)
		p.add("b", turn, 3*time.Second)
		p.add("a", time.Time{}, 0)
		p.add("b", turn.Add(-time.Second), 2*time.Second)
		p.stop()
		got := log.lines("level=INFO")
		if len(got) != 2 || !strings.Contains(got[0], "rule=a parked=1 interval=10s in_line=1\n") ||
			!strings.Contains(got[1], "rule=b parked=2 interval=10s furthest_turn=2000-01-01T00:00:03.000Z furthest_ahead=3s\n") {
			t.Errorf("lines at stop:\n%s\nwant a's then b's summary", strings.Join(got, ""))
		}
		time.Sleep(2 * ParkSummaryEvery)
		if n := len(log.lines("level=INFO")); n != 2 {
			t.Errorf("%d lines after the interval, want the 2 of stop only", n)
		}
	})
}
