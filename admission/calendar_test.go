package admission

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestGateCalendarQuota: jobs over a daily quota (5 a day in Los Angeles,
// beside 10/s) do not wait in their slots for midnight: they park in the
// subject's line at once, booked nothing, and each serving at a midnight
// hands out that day's quota, 100ms apart (the 10/s). Every job runs
// once, at most 5 a calendar day (one of them the 23-hour day daylight
// saving starts), and the calls stay a few per job.
func TestGateCalendarQuota(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		la, err := time.LoadLocation("America/Los_Angeles")
		if err != nil {
			t.Fatal(err)
		}
		lim, err := throttle.New(rdb, throttle.Options{},
			throttle.Rule{Name: "second", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
			throttle.Rule{Name: "daily", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: 5}, Calendar: throttle.Daily(la)})
		if err != nil {
			t.Fatal(err)
		}
		g, err := New(lim, Options{EarlyWait: 100 * ms, Settings: Settings{MaxWait: time.Second, WaitSlots: 2}})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Until(time.Date(2000, 4, 1, 23, 0, 0, 0, la)))
		calls := redistest.CountScripts(rdb)
		ctx := context.Background()
		var mu sync.Mutex
		woken := map[string]chan time.Time{}
		serveAt := make(chan time.Time, 64)
		perDay := map[string]int{}
		const jobs = 20
		var wg sync.WaitGroup
		for i := range jobs {
			id := fmt.Sprintf("job-%02d", i)
			woken[id] = make(chan time.Time, 1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
				if err != nil {
					t.Errorf("Admit %s: %v", id, err)
					return
				}
				if d.Waited > time.Second {
					t.Errorf("%s held its slot %v", id, d.Waited)
				}
				if d.Outcome == Park {
					if d.InLine {
						if !d.Serve.IsZero() {
							serveAt <- d.Serve
						}
						d.At = <-woken[id]
					}
					time.Sleep(time.Until(d.At))
					back, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id}})
					if err != nil || back.Outcome != Run || back.Status != throttle.Redeemed {
						t.Errorf("%s back at its turn: %+v, %v; want run on its booking", id, back, err)
						return
					}
				}
				mu.Lock()
				perDay[time.Now().In(la).Format(time.DateOnly)]++
				mu.Unlock()
			}()
		}
		serves := serveLineUntilEmpty(t, ctx, g, "acct", serveAt, &mu, woken)
		wg.Wait()
		want := map[string]int{"2000-04-01": 5, "2000-04-02": 5, "2000-04-03": 5, "2000-04-04": 5}
		if fmt.Sprint(perDay) != fmt.Sprint(want) {
			t.Errorf("jobs run per day in Los Angeles: %v; want %v", perDay, want)
		}
		if c := calls.Load(); c > 3*jobs {
			t.Errorf("%d script calls for %d jobs (%d servings); want at most 3 a job", c, jobs, serves.Load())
		}
		t.Logf("%d script calls for %d jobs, %d servings", calls.Load(), jobs, serves.Load())
	})
}
