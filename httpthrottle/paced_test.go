package httpthrottle

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A paced Transport (Options.Paced, as the worker's http handler has: its
// requests go on turns that Limiter.Admit spaced at the learned rate)
// books a departure only for its process's first request to a subject. A
// backlog in three processes parks once per task (two admissions each),
// no request is refused after the first answer, and no second holds more
// than the API's 20 + 1.
func TestTransportPacedByAdmission(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &limitedUpstream{limit: 20, style: styleIETF}
		trs := fleet(t, m, up, 3, fast, Options{NoWait: true, Paced: true})
		const tasks, goroutines = 300, 4
		var next, admits, refused atomic.Int64
		var wg sync.WaitGroup
		for _, tr := range trs {
			c := &http.Client{Transport: tr}
			for range goroutines {
				wg.Go(func() {
					for i := next.Add(1); i <= tasks; i = next.Add(1) {
						id := fmt.Sprintf("task-%d", i)
						for !runPaced(t, tr.lim, c, id, &admits) {
							refused.Add(1)
						}
					}
				})
			}
		}
		wg.Wait()
		calls, _ := up.log()
		if n := refused.Load(); n != 0 {
			t.Errorf("%d requests refused; want none: the first answer paces every admission", n)
		}
		if got := admits.Load(); got > tasks*22/10 {
			t.Errorf("%d admissions for %d tasks; want at most 2.2 a task (one park, one redemption)", got, tasks)
		}
		n := m.HGet(hashKey(m), "n")
		if n != "1" && n != "2" && n != "3" {
			t.Errorf("%s departures booked; want one per process at most (the first request of each)", n)
		}
		if got := maxIn(calls, time.Second); got > 21 {
			t.Errorf("%d requests in one second at the API; want at most 21", got)
		}
		if last, want := calls[len(calls)-1], secs(tasks/(throttle.LearnedShare*20)); last > want+time.Second {
			t.Errorf("%d tasks took %v; want about %v (95 %% of the API's 20/s)", tasks, last, want)
		}
	})
}

// runPaced admits task id as the worker middleware does (a turn later
// than now parks: the task comes back at it), then sends its request; it
// reports whether the API accepted it.
func runPaced(t *testing.T, lim *throttle.Limiter, c *http.Client, id string, admits *atomic.Int64) bool {
	for {
		a, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "api.example", N: 1, ID: id})
		admits.Add(1)
		if err != nil {
			t.Error(err)
			return true
		}
		time.Sleep(time.Until(a.At))
		if a.Status != throttle.Granted && a.Status != throttle.Redeemed {
			continue
		}
		// As the worker's http handler does: a task that waited for its
		// turn does not send if a pause overtook it.
		if left, err := lim.PauseFor(context.Background(), "api.example", 0); err != nil || left > 0 {
			continue
		}
		return get(t, c, "http://api.example/") == http.StatusOK
	}
}

// hashKey is the one upstream hash in m.
func hashKey(m *miniredis.Miniredis) string {
	for _, k := range m.Keys() {
		if strings.Contains(k, "!upstream(") {
			return k
		}
	}
	return ""
}
