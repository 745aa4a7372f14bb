package httpthrottle

import (
	"github.com/jobthrottle/jobthrottle/throttle"

	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// upstream is an in-memory third-party API (a network server would keep a
// synctest bubble from ever advancing its clock). It answers 429 with
// Retry-After to every request that comes before its own gate opens, and
// the first request closes the gate for pause.
type upstream struct {
	pause   string        // Retry-After of the first answer
	delay   time.Duration // how long each answer takes
	mu      sync.Mutex
	calls   []time.Duration // arrival of every request, offset from the bubble's start
	openAt  time.Time       // the gate
	tooMany int
}

func (u *upstream) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		_ = req.Body.Close()
	}
	u.mu.Lock()
	now := time.Now()
	u.calls = append(u.calls, at())
	rec := httptest.NewRecorder()
	rec.Header().Set("Date", now.UTC().Format(http.TimeFormat))
	switch {
	case len(u.calls) == 1:
		d, _ := ParseRetryAfter(u.pause, now)
		u.openAt = now.Add(d)
		rec.Header().Set("Retry-After", u.pause)
		rec.WriteHeader(http.StatusTooManyRequests)
		u.tooMany++
	case now.Before(u.openAt):
		rec.Header().Set("Retry-After", "1")
		rec.WriteHeader(http.StatusTooManyRequests)
		u.tooMany++
	default:
		rec.WriteHeader(http.StatusOK)
	}
	u.mu.Unlock()
	time.Sleep(u.delay)
	return rec.Result(), nil
}

// newWorker builds what one worker process has: its own Redis client (to
// the shared miniredis), its own throttle.Limiter and Transport.
func newWorker(t *testing.T, m *miniredis.Miniredis, base http.RoundTripper, rule throttle.Rule) *http.Client {
	t.Helper()
	rdb := redistest.PipeClient(m)
	t.Cleanup(func() { _ = rdb.Close() })
	tr, err := New(mustNew(t, rdb, throttle.Options{}, rule), Options{Base: base})
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Transport: tr}
}

func get(t *testing.T, c *http.Client, url string) int {
	t.Helper()
	return getCtx(t, context.Background(), c, url)
}

// One 429 with Retry-After: 2 pauses both workers: the one that was told,
// the other one (its own process, sharing only Redis), and a request of the
// other that had already booked its slot before the 429 came.
func TestTransportPauseReachesEveryWorker(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &upstream{pause: "2", delay: 100 * ms}
		rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(2).WithBurst(1)}
		a := newWorker(t, m, up, rule)
		b := newWorker(t, m, up, rule)

		var wg sync.WaitGroup
		wg.Go(func() {
			if code := get(t, a, "http://api.example/first"); code != http.StatusTooManyRequests {
				t.Errorf("first request: %d, want 429", code)
			}
		})
		// a's request is at the upstream, slot 0 taken; b books the slot at 500ms.
		synctest.Wait()
		wg.Go(func() { get(t, b, "http://api.example/booked") })
		wg.Wait()
		// The 429 came at 100ms: the gate opens at 2.1s. b's request found
		// the pause when its slot came and booked again, after it.
		for range 3 {
			wg.Go(func() { get(t, a, "http://api.example/a") })
			wg.Go(func() { get(t, b, "http://api.example/b") })
		}
		wg.Wait()

		if up.tooMany != 1 {
			t.Errorf("upstream answered %d 429s, want 1", up.tooMany)
		}
		if len(up.calls) != 8 {
			t.Fatalf("upstream saw %d requests, want 8", len(up.calls))
		}
		for i, c := range up.calls[1:] {
			// throttle.Every later request at or after the gate, 500ms apart.
			if want := 2100*ms + time.Duration(i)*500*ms; c != want {
				t.Errorf("request %d at %v, want %v", i+2, c, want)
			}
		}
	})
}

// A Retry-After as an HTTP-date is read against the response's Date, and
// a 503 pauses too.
func TestTransportHTTPDate503(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		var calls []time.Duration
		base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			calls = append(calls, at())
			rec := httptest.NewRecorder()
			if len(calls) == 1 {
				// The server's clock is an hour ahead of ours: only the
				// difference between its Date and its Retry-After counts.
				date := time.Now().Add(time.Hour).UTC()
				rec.Header().Set("Date", date.Format(http.TimeFormat))
				rec.Header().Set("Retry-After", date.Add(3*time.Second).Format(http.TimeFormat))
				rec.WriteHeader(http.StatusServiceUnavailable)
			}
			return rec.Result(), nil
		})
		c := newWorker(t, m, base, throttle.Rule{Name: "api", Algorithm: throttle.TokenBucket, Limit: throttle.PerSecond(10)})
		get(t, c, "http://api.example/")
		get(t, c, "http://api.example/")
		if len(calls) != 2 || calls[1] != 3*time.Second {
			t.Errorf("calls at %v, want [0s 3s]", calls)
		}
	})
}

// Responses that do not ask for a pause, or ask in a way that does not
// parse, pause nothing; absurd pauses are capped at MaxPause.
func TestTransportWhenToPause(t *testing.T) {
	cases := []struct {
		name       string
		status     int
		retryAfter string
		maxPause   time.Duration
		want       time.Duration // the pause the subject gets
	}{
		{"429 delta", 429, "2", 0, 2 * time.Second},
		{"503 delta", 503, "7", 0, 7 * time.Second},
		{"429 no header", 429, "", 0, 0},
		{"429 garbage", 429, "soon", 0, 0},
		{"429 negative", 429, "-5", 0, 0},
		{"429 zero", 429, "0", 0, 0},
		{"200 with header", 200, "30", 0, 0},
		{"500 with header", 500, "30", 0, 0},
		{"capped at default", 429, "999999999999999999999", 0, DefaultMaxPause},
		{"capped at option", 429, "3600", time.Minute, time.Minute},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				lim := mustNew(t, rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)})
				var paused []time.Duration
				tr, err := New(lim, Options{
					MaxPause: c.maxPause,
					Base: roundTripFunc(func(*http.Request) (*http.Response, error) {
						rec := httptest.NewRecorder()
						if c.retryAfter != "" {
							rec.Header().Set("Retry-After", c.retryAfter)
						}
						rec.WriteHeader(c.status)
						return rec.Result(), nil
					}),
					OnPause: func(subject string, d time.Duration, err error) {
						if subject != "api.example:8080" || err != nil {
							t.Errorf("OnPause(%q, %v, %v)", subject, d, err)
						}
						paused = append(paused, d)
					},
				})
				if err != nil {
					t.Fatal(err)
				}
				resp, err := (&http.Client{Transport: tr}).Get("http://api.example:8080/x")
				if err != nil {
					t.Fatal(err)
				}
				if resp.StatusCode != c.status {
					t.Errorf("status %d, want %d: the response is passed on unchanged", resp.StatusCode, c.status)
				}
				left, err := lim.PauseFor(context.Background(), "api.example:8080", 0)
				if err != nil || left != c.want {
					t.Errorf("Paused = %v, %v; want %v", left, err, c.want)
				}
				if (c.want > 0) != (len(paused) == 1) || (c.want > 0 && paused[0] != c.want) {
					t.Errorf("OnPause calls %v, want one with %v", paused, c.want)
				}
			})
		})
	}
}

// trackedBody records whether the transport closed it.
type trackedBody struct {
	io.Reader
	closed atomic.Bool
}

func (b *trackedBody) Close() error { b.closed.Store(true); return nil }

// A request whose context ends while it waits returns at once, is never
// sent, closes its body and gives its slot back.
func TestTransportCancelWhileWaiting(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim := mustNew(t, rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Second, Burst: 1}})
		var sent atomic.Int64
		tr, _ := New(lim, Options{Base: roundTripFunc(func(*http.Request) (*http.Response, error) {
			sent.Add(1)
			return httptest.NewRecorder().Result(), nil
		})})
		c := &http.Client{Transport: tr}
		get(t, c, "http://h/") // takes the slot at 0; the next is at 1s

		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(200*ms, cancel)
		body := &trackedBody{Reader: strings.NewReader("payload")}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://h/", body)
		start := at()
		_, err := c.Do(req)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Do: %v, want context.Canceled", err)
		}
		if got := at() - start; got != 200*ms {
			t.Errorf("returned after %v, want 200ms (when cancelled)", got)
		}
		if !body.closed.Load() {
			t.Error("request body not closed")
		}
		if sent.Load() != 1 {
			t.Errorf("%d requests sent, want 1", sent.Load())
		}
		// The refunded slot at 1s is free again.
		if res := allow(t, lim, "h", 1); res.Allowed || res.RetryAfter != 800*ms {
			t.Errorf("after cancel: allowed=%v RetryAfter=%v; want denied, 800ms", res.Allowed, res.RetryAfter)
		}
	})
}

// A wait longer than the request's deadline fails at once, unsent.
func TestTransportDeadline(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim := mustNew(t, rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Second, Burst: 1}})
		if _, err := lim.PauseFor(context.Background(), "h", time.Minute); err != nil {
			t.Fatal(err)
		}
		tr, _ := New(lim, Options{Base: roundTripFunc(func(*http.Request) (*http.Response, error) {
			t.Error("request sent during the pause")
			return nil, errors.New("unreachable")
		})})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://h/", nil)
		start := at()
		_, err := (&http.Client{Transport: tr}).Do(req)
		var de *throttle.DelayError
		if !errors.As(err, &de) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Do: %v, want a *throttle.DelayError matching context.DeadlineExceeded", err)
		}
		if at() != start {
			t.Errorf("took %v, want an immediate failure", at()-start)
		}
	})
}

// Window limiters decide when the permit is granted, so a pause reaches
// their waiters without any re-check.
func TestTransportWindowLimiter(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &upstream{pause: "3"}
		rule := throttle.Rule{Name: "api", Algorithm: throttle.SlidingLog, Limit: throttle.PerSecond(1)}
		a, b := newWorker(t, m, up, rule), newWorker(t, m, up, rule)
		var wg sync.WaitGroup
		for range 3 {
			wg.Go(func() { get(t, a, "http://api/") })
			wg.Go(func() { get(t, b, "http://api/") })
		}
		wg.Wait()
		if up.tooMany != 1 {
			t.Errorf("%d 429s, want 1 (calls at %v)", up.tooMany, up.calls)
		}
		for _, c := range up.calls[1:] {
			if c != 0 && c < 3*time.Second {
				t.Errorf("request at %v, during the pause", c)
			}
		}
	})
}

func TestTransportSubjectAndErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		lim := mustNew(t, rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Second, Burst: 1}})
		if _, err := New(nil, Options{}); err == nil {
			t.Error("nil limiter accepted")
		}
		if _, err := New(lim, Options{MaxPause: -1}); err == nil {
			t.Error("negative MaxPause accepted")
		}
		var got []string
		tr, _ := New(lim, Options{
			Subject: func(r *http.Request) string { return r.Header.Get("X-Tenant") },
			Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
				got = append(got, r.Header.Get("X-Tenant"))
				return httptest.NewRecorder().Result(), nil
			}),
		})
		c := &http.Client{Transport: tr}
		for _, tenant := range []string{"t1", "t2", "t1"} {
			req, _ := http.NewRequest(http.MethodGet, "http://h/", nil)
			req.Header.Set("X-Tenant", tenant)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
		}
		// t1 and t2 are separate subjects: only t1's second request waited.
		if at() != time.Second || len(got) != 3 {
			t.Errorf("3 requests took %v (sent %v), want 1s", at(), got)
		}
		req, _ := http.NewRequest(http.MethodGet, "http://h/", nil)
		if _, err := c.Do(req); !errors.Is(err, throttle.ErrInvalidSubject) {
			t.Errorf("empty subject: %v, want ErrInvalidSubject", err)
		}
	})
}

// TestTransportRefusesConcurrency: a Transport would take a concurrency
// rule's places and never release them, so New refuses such a limiter
// unless NoWait (the caller waits and releases), without asking Redis.
func TestTransportRefusesConcurrency(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer rdb.Close()
	lim, err := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "rate", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
		throttle.Rule{Name: "running", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	var ce *throttle.ConfigError
	if _, err := New(lim, Options{}); !errors.As(err, &ce) || ce.Rule != "running" || ce.Field != "algorithm" {
		t.Errorf("New without NoWait: %v, want a *throttle.ConfigError on rule running's algorithm", err)
	}
	if _, err := New(lim, Options{NoWait: true}); err != nil {
		t.Errorf("New with NoWait: %v", err)
	}
	rate, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "rate", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(rate, Options{}); err != nil {
		t.Errorf("New on a rate limiter: %v", err)
	}
}

// refusing is an API that accepts every request but those whose numbers
// (from 1) are in refuse, which it answers 429 with Retry-After: 1; every
// answer announces a policy of 20 per second. It records every request.
type refusing struct {
	refuse map[int]bool
	mu     sync.Mutex
	calls  []time.Duration
}

func (u *refusing) RoundTrip(*http.Request) (*http.Response, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls = append(u.calls, at())
	rec := httptest.NewRecorder()
	rec.Header().Set("RateLimit-Policy", `"default";q=20;w=1`)
	if u.refuse[len(u.calls)] {
		rec.Header().Set("Retry-After", "1")
		rec.WriteHeader(http.StatusTooManyRequests)
	}
	return rec.Result(), nil
}

// An isolated 429 under a learned rate lowers the rate and pauses no one:
// the fleet goes on at the slower rate, never stopping for the 429's
// Retry-After. A second 429 soon after the lowering (within its
// Retry-After, to a request booked after it) says that the lowering did
// not help: that one pauses every process.
func TestTransportIsolated429DoesNotPause(t *testing.T) {
	cases := []struct {
		name    string
		refuse  map[int]bool
		lowered int64
		pause   bool // a gap of a second or more in the requests
	}{
		{"isolated", map[int]bool{20: true}, 1, false},
		{"two apart", map[int]bool{20: true, 60: true}, 2, false},
		{"repeated", map[int]bool{20: true, 30: true}, 2, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
				up := &refusing{refuse: c.refuse}
				trs := fleet(t, m, up, 2, fast, Options{})
				backlog(t, trs, 2, 80)
				if got := trs[0].Stats().Lowered + trs[1].Stats().Lowered; got != c.lowered {
					t.Errorf("the rate was lowered %d times; want %d", got, c.lowered)
				}
				paused := trs[0].Stats().Paused + trs[1].Stats().Paused
				longest := time.Duration(0)
				for i := 1; i < len(up.calls); i++ {
					longest = max(longest, up.calls[i]-up.calls[i-1])
				}
				if pause := longest >= time.Second; pause != c.pause || (paused > 0) != c.pause {
					t.Errorf("longest gap between requests %v, %d pauses; want a fleet pause: %v", longest, paused, c.pause)
				}
			})
		})
	}
}
