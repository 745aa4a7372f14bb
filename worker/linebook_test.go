package worker

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// TestLineWaiting: with a horizon of 1s, a backlog of 10 tasks at 1/s
// waits in its subject's line; after each serving jobthrottle_line_waiting
// (and the activity's LineWaiting) is the line's length in Redis, which
// falls to 0 once the line is empty.
func TestLineWaiting(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		start := time.Now()
		b, m, stop := activityBed(t, rdb, "1s")
		defer stop()
		eventually(t, 5*time.Second, "9 tasks parked", func() bool { return m.Activity().Rule("api").Decisions[admission.LabelParked] == 9 })
		lineLen := func() int {
			keys, err := rdb.Keys(ctx, b.prefix+"*!line(api)").Result()
			if err != nil || len(keys) > 1 {
				t.Fatalf("line keys %q (%v); want at most one", keys, err)
			}
			if len(keys) == 0 {
				return 0
			}
			return int(rdb.ZCard(ctx, keys[0]).Val())
		}
		var seen []int
		for sec := 3; sec <= 12; sec++ {
			// A serving books the next turn half a second before it; the
			// line does not change between servings.
			time.Sleep(time.Until(start.Add(time.Duration(sec)*time.Second + 800*time.Millisecond)))
			want := lineLen()
			if got := testutil.ToFloat64(m.lines); got != float64(want) {
				t.Errorf("at %ds: jobthrottle_line_waiting = %v; the line holds %d", sec, got, want)
			}
			if got := m.Activity().Rule("api").LineWaiting; got != want {
				t.Errorf("at %ds: activity LineWaiting = %d; the line holds %d", sec, got, want)
			}
			seen = append(seen, want)
		}
		// Falling by one or two at each serving (a head back for its turn
		// books it and the next, at the horizon: throttle.AdmitRequest.HeadServes;
		// which of the two happens at an instant depends on the order the
		// bubble's goroutines run in), never rising, to 0.
		falling := seen[0] >= 3 && seen[len(seen)-1] == 0
		steps := 0
		for i := 1; i < len(seen); i++ {
			if seen[i] > seen[i-1] {
				falling = false
			}
			if seen[i] < seen[i-1] {
				steps++
			}
		}
		if !falling || steps < 3 {
			t.Errorf("line lengths seen each second %v; want a backlog of at least 3 falling to 0 in at least 3 steps, never rising", seen)
		}
		eventually(t, 15*time.Second, "10 tasks ran", func() bool { return len(b.runs()) == 10 })
		if got := testutil.ToFloat64(m.lines); got != 0 {
			t.Errorf("after the runs: jobthrottle_line_waiting = %v; want 0", got)
		}
	})
}

// A line's length counts until a few servings after the next serving it
// announced: a line another process serves now drops out; a serving that
// empties it drops it at once; the gauge sums a rule's lines.
func TestLineBookStale(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, _ := NewMetrics(prometheus.NewRegistry())
		now := time.Now()
		m.lineServed("r", "a", admission.Served{Waiting: 4, Next: now.Add(500 * time.Millisecond)})
		m.lineServed("r", "b", admission.Served{Waiting: 3, Next: now.Add(5 * time.Second)})
		if got := testutil.ToFloat64(m.lines); got != 7 {
			t.Fatalf("two lines of 4 and 3: gauge %v; want 7", got)
		}
		time.Sleep(500*time.Millisecond + lineStale + time.Millisecond)
		if got := m.Activity().Rule("r").LineWaiting; got != 3 {
			t.Errorf("a's count past its next serving and lineStale: %d waiting; want b's 3", got)
		}
		m.lineServed("r", "b", admission.Served{Waiting: 0})
		if got := testutil.ToFloat64(m.lines); got != 0 {
			t.Errorf("b's line emptied: gauge %v; want 0", got)
		}
	})
}
