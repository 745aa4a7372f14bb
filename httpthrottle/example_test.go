package httpthrottle_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// An HTTP client whose calls to a third party are paced by a limit shared
// through Redis. The API answers the first call 429 with Retry-After: 1;
// the transport pauses the host for every client of that Redis, so the
// second call goes out a second later and succeeds.
func Example() {
	m, err := miniredis.Run() // on real time: the pause must end
	if err != nil {
		panic(err)
	}
	defer m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()

	var calls atomic.Int32
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer api.Close()

	lim, err := throttle.New(rdb, throttle.Options{Prefix: "myapp:"},
		throttle.Rule{Name: "partner-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
	if err != nil {
		panic(err)
	}
	tr, err := httpthrottle.New(lim, httpthrottle.Options{}) // subject: the request's host
	if err != nil {
		panic(err)
	}
	client := &http.Client{Transport: tr}

	start := time.Now()
	for range 2 {
		resp, err := client.Get(api.URL)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Printf("%d after %v\n", resp.StatusCode, time.Since(start).Truncate(time.Second))
	}
	// Output:
	// 429 after 0s
	// 200 after 1s
}

// What an upstream's rate-limit headers say; Transport reads every
// response this way and follows a limit tighter than its own.
func ExampleParseRateLimitHeaders() {
	h := http.Header{}
	h.Set("RateLimit-Policy", `"default";q=100;w=60`)
	h.Set("RateLimit", `"default";r=0;t=12`)
	info, ok := httpthrottle.ParseRateLimitHeaders(h, time.Now())
	fmt.Println(ok, info.Quota, info.Window, info.Remaining, info.Reset)
	// Output: true 100 1m0s 0 12s
}
