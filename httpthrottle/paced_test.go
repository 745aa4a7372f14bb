package httpthrottle

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
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
// requests go on turns that Limiter.Admit spaces at the learned rate, and
// books as their departures) asks Redis for few departures of its own.
// From an upstream that teaches none, the requests of three processes
// leave on their admitted turns (one departure each, the first); from one
// that announces 20/s, on the turns Admit booked as their departures (but
// the requests in flight when the rate was learned), and none is refused.
// Either way a backlog parks about once per task: at most 2.2 admissions,
// and so about 2 decision calls, each.
func TestTransportPacedByAdmission(t *testing.T) {
	for _, c := range []struct {
		name             string
		limit            int
		style            string
		minDeps, maxDeps int
		maxDepartCalls   int64
	}{
		{"nothing learned", 1000, styleBare, 1, 3, 3},
		{"a policy learned", 20, styleIETF, 300, 320, 15},
	} {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
				up := &limitedUpstream{limit: c.limit, style: c.style}
				trs := fleet(t, m, up, 3, fast, Options{NoWait: true, Paced: true})
				const tasks = 300
				admits, refused := pacedBacklog(t, trs, tasks)
				if refused != 0 {
					t.Errorf("%d requests refused; want none", refused)
				}
				if admits > tasks*22/10 {
					t.Errorf("%d admissions for %d tasks; want at most 2.2 a task (one park, one redemption)", admits, tasks)
				}
				n, _ := strconv.Atoi(m.HGet(hashKey(m), "n"))
				if n < c.minDeps || n > c.maxDeps {
					t.Errorf("%d departures booked; want %d to %d", n, c.minDeps, c.maxDeps)
				}
				departs := int64(0)
				for _, tr := range trs {
					st := tr.Stats()
					departs += st.Sent - st.OnTurn
				}
				if c.limit < 100 && departs > c.maxDepartCalls {
					t.Errorf("%d requests departed with a call of their own; want at most %d (the rest on their turns)", departs, c.maxDepartCalls)
				}
				if calls, _ := up.log(); maxIn(calls, time.Second) > min(c.limit, 100)+1 {
					t.Errorf("%d requests in one second at the API; want at most %d", maxIn(calls, time.Second), min(c.limit, 100)+1)
				}
			})
		})
	}
}

// pacedBacklog runs tasks through the transports, 4 at a time in each, as
// the worker does (runPaced), and returns the admissions and the requests
// refused.
func pacedBacklog(t *testing.T, trs []*Transport, tasks int) (admits, refused int64) {
	var next, a, r atomic.Int64
	var wg sync.WaitGroup
	for _, tr := range trs {
		c := &http.Client{Transport: tr}
		for range 4 {
			wg.Go(func() {
				for i := next.Add(1); i <= int64(tasks); i = next.Add(1) {
					for !runPaced(t, tr.lim, c, fmt.Sprintf("task-%d", i), &a) {
						r.Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	return a.Load(), r.Load()
}

// runPaced admits task id as the worker middleware does (a turn later
// than now parks: the task comes back at it), then sends its request; it
// reports whether the API accepted it.
func runPaced(t *testing.T, lim *throttle.Limiter, c *http.Client, id string, admits *atomic.Int64) bool {
	for {
		decided := time.Now()
		a, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "api.example", N: 1, Caller: throttle.Caller{ID: id}})
		admits.Add(1)
		if err != nil {
			t.Error(err)
			return true
		}
		time.Sleep(time.Until(a.At))
		if a.Status != throttle.Granted && a.Status != throttle.Redeemed {
			continue
		}
		// A pause that overtook the turn holds the request back in the
		// transport (TestPacedTurnAfterPause).
		ctx := WithTurn(context.Background(), Turn{At: a.At, Decided: decided})
		return getCtx(t, ctx, c, "http://api.example/") == http.StatusOK
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

// getCtx is get with a context.
func getCtx(t *testing.T, ctx context.Context, c *http.Client, url string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Errorf("GET %s: %v", url, err)
		return 0
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}

// A paced request leaves on its admitted turn without a departure of its
// own (with a rate learned, the departure Admit booked for the turn; with
// none, at once): but a pause another process recorded while the turn was
// waiting holds it back until the pause ends, as a departure would be.
// Before, the transport sent it at its turn, into the pause (the worker's
// http handler read the pause itself, before every request).
func TestPacedTurnAfterPause(t *testing.T) {
	for _, c := range []struct {
		name, style string
	}{
		{"a rate learned", styleIETF},
		{"nothing learned", styleBare},
	} {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				ctx := context.Background()
				up := &limitedUpstream{limit: 20, style: c.style}
				tr := fleet(t, m, up, 1, fast, Options{NoWait: true, Paced: true})[0]
				client := &http.Client{Transport: tr}
				if code := getCtx(t, ctx, client, "http://api.example/"); code != http.StatusOK {
					t.Fatalf("the first request: %d", code)
				}
				time.Sleep(time.Second)
				var a throttle.Admission
				decided := time.Now()
				for _, id := range []string{"a", "b"} { // b's turn comes after a's
					var err error
					if a, err = tr.lim.Admit(ctx, throttle.AdmitRequest{Subject: "api.example", N: 1, Caller: throttle.Caller{ID: id}, Wait: time.Second}); err != nil {
						t.Fatal(err)
					}
				}
				if a.Delay <= 0 {
					t.Fatalf("b's turn in %v; want later than now", a.Delay)
				}
				// Another process is told to pause the subject meanwhile.
				other := mustNew(t, rdb, throttle.Options{}, fast)
				if _, err := other.PauseFor(ctx, "api.example", 500*time.Millisecond); err != nil {
					t.Fatal(err)
				}
				end := at() + 500*time.Millisecond
				time.Sleep(time.Until(a.At))
				tctx := WithTurn(ctx, Turn{At: a.At, Decided: decided})
				if code := getCtx(t, tctx, client, "http://api.example/"); code != http.StatusOK {
					t.Errorf("b's request answered %d; want 200", code)
				}
				calls, _ := up.log()
				if got := calls[len(calls)-1]; got < end {
					t.Errorf("b's request reached the API at %v, within the pause (until %v); want after it", got, end)
				}
			})
		})
	}
}
