// Command outbound-api shows httpthrottle.Transport pacing calls to a third
// party that enforces its own limit, and turning its 429 + Retry-After
// into a pause that every worker honours.
//
// Four workers, each with its own Redis client, limiter and transport (as
// four processes would have), share only Redis (an in-process miniredis
// here). They are allowed 8 requests per second with bursts of 8; the fake
// API allows at most 5 in any 500 ms and answers the rest with 429 and
// Retry-After: 1. The opening burst gets a few 429s; the pause then holds
// every worker for a second, and the steady 8 per second (4 per 500 ms)
// never hits the API's limit again. A job whose call got a 429 is retried,
// and its retry waits out the pause.
//
//	go run ./examples/outbound-api
//
// It uses throttle only; as a program, nothing imports it.
package main

import (
	"fmt"
	"log"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const (
	jobs    = 40
	workers = 4
)

func main() {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer mr.Close()

	api := newFakeAPI(5, 500*time.Millisecond)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Handler: api}
	go srv.Serve(ln)
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/v1/things"

	rule := throttle.Rule{Name: "partner-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(8)}
	queue := make(chan int, jobs)
	for i := range jobs {
		queue <- i
	}
	close(queue)

	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		// One worker process: its own client, limiter and transport.
		rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		defer rdb.Close()
		lim, err := throttle.New(rdb, throttle.Options{Prefix: "demo:"}, rule)
		if err != nil {
			log.Fatal(err)
		}
		tr, err := httpthrottle.New(lim, httpthrottle.Options{
			OnPause: func(subject string, d time.Duration, err error) {
				fmt.Printf("%6.2fs  worker %d: 429 from %s: every worker pauses %v\n", time.Since(start).Seconds(), w, subject, d)
			},
		})
		if err != nil {
			log.Fatal(err)
		}
		client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		wg.Go(func() {
			for job := range queue {
				// A job is retried until the API accepts it, as asynq
				// would retry a failed task.
				for {
					resp, err := client.Get(fmt.Sprintf("%s?job=%d", url, job))
					if err != nil {
						log.Fatalf("worker %d: %v", w, err)
					}
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						break
					}
				}
			}
		})
	}
	wg.Wait()

	ok, tooMany, first, last := api.stats()
	fmt.Printf("\n%d jobs done by %d workers in %.1fs\n", jobs, workers, time.Since(start).Seconds())
	fmt.Printf("the API answered %d requests: %d OK, %d × 429", ok+tooMany, ok, tooMany)
	if tooMany > 0 {
		fmt.Printf(" (all between %.2fs and %.2fs: the opening burst, before the pause took hold)", first.Sub(start).Seconds(), last.Sub(start).Seconds())
	}
	fmt.Println()
}

// fakeAPI admits at most limit requests in any window and answers the
// others 429 with Retry-After: 1, as many third-party APIs do.
type fakeAPI struct {
	limit  int
	window time.Duration

	mu          sync.Mutex
	admitted    []time.Time
	ok, tooMany int
	first, last time.Time // of the 429s
}

func newFakeAPI(limit int, window time.Duration) *fakeAPI {
	return &fakeAPI{limit: limit, window: window}
}

func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	now := time.Now()
	for len(a.admitted) > 0 && now.Sub(a.admitted[0]) >= a.window {
		a.admitted = a.admitted[1:]
	}
	if len(a.admitted) >= a.limit {
		a.tooMany++
		if a.first.IsZero() {
			a.first = now
		}
		a.last = now
		a.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
		return
	}
	a.admitted = append(a.admitted, now)
	a.ok++
	a.mu.Unlock()
	fmt.Fprintln(w, `{"ok": true}`)
}

func (a *fakeAPI) stats() (ok, tooMany int, first, last time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.ok, a.tooMany, a.first, a.last
}
