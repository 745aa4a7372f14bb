package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// A monthly quota beside a per-second limit, in one policy, on every
// backend (a cluster included: one script over keys of one slot). Real
// servers keep real time, so the assertions hold whatever second of the
// month the test runs in: the quota's window ends on the first of the next
// month, UTC, as the Redis clock reads it.
func TestBackendsCalendar(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "second", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)},
				throttle.Rule{Name: "month", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: 3}, Calendar: throttle.Monthly(nil)})
			if err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				if res, err := l.Allow(ctx, "s"); err != nil || !res.Allowed {
					t.Fatalf("request %d: %+v, %v; want allowed", i, res, err)
				}
			}
			res, err := l.Allow(ctx, "s")
			if err != nil || res.Allowed || res.Rule != "month" {
				t.Fatalf("4th request: %+v, %v; want denied by the monthly quota", res, err)
			}
			tm, err := b.Client.Time(ctx).Result()
			if err != nil {
				t.Fatal(err)
			}
			_, end := throttle.Monthly(nil).Window(tm)
			if d := end.Sub(tm) - res.RetryAfter; d < -2*time.Second || d > 2*time.Second {
				t.Errorf("RetryAfter %v; want until the first of next month, %v from Redis's now", res.RetryAfter, end.Sub(tm))
			}
			ttl, err := b.Client.PTTL(ctx, prefix+"{s}:month").Result()
			if err != nil || ttl <= 0 || ttl > end.Sub(tm)+2*time.Second {
				t.Errorf("PTTL = %v, %v; want until the window's end, %v", ttl, err, end.Sub(tm))
			}
		})
	}
}
