package httpthrottle

import (
	"github.com/jobthrottle/jobthrottle/throttle"

	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

func TestParseRateLimitHeaders(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	cases := []struct {
		name    string
		headers map[string][]string
		want    RateLimitInfo
		ok      bool
	}{
		{"none", nil, RateLimitInfo{}, false},
		{"ietf structured", map[string][]string{
			"RateLimit-Policy": {`"default";q=100;w=10`},
			"RateLimit":        {`"default";r=42;t=7`},
		}, RateLimitInfo{Quota: 100, Window: 10 * time.Second, Remaining: 42, HasRemaining: true, Reset: 7 * time.Second, HasReset: true}, true},
		{"ietf several policies: the slowest", map[string][]string{
			"RateLimit-Policy": {`"burst";q=100;w=1, "daily";q=1000;w=86400`},
		}, RateLimitInfo{Quota: 1000, Window: 86400 * time.Second}, true},
		{"ietf several remaining: the least", map[string][]string{
			"RateLimit": {`"a";r=40;t=1, "b";r=3;t=60`},
		}, RateLimitInfo{Remaining: 3, HasRemaining: true, Reset: time.Minute, HasReset: true}, true},
		{"ietf dictionary draft", map[string][]string{
			"RateLimit":        {`limit=100, remaining=0, reset=3`},
			"RateLimit-Policy": {`100;w=60`},
		}, RateLimitInfo{Quota: 100, Window: time.Minute, Remaining: 0, HasRemaining: true, Reset: 3 * time.Second, HasReset: true}, true},
		{"ietf separate fields", map[string][]string{
			"RateLimit-Limit": {"100"}, "RateLimit-Remaining": {"9"}, "RateLimit-Reset": {"2"},
		}, RateLimitInfo{Remaining: 9, HasRemaining: true, Reset: 2 * time.Second, HasReset: true}, true},
		{"x-ratelimit delta", map[string][]string{
			"X-Ratelimit-Limit": {"60"}, "X-Ratelimit-Remaining": {"59"}, "X-Ratelimit-Reset": {"1.5"},
		}, RateLimitInfo{Remaining: 59, HasRemaining: true, Reset: 1500 * time.Millisecond, HasReset: true}, true},
		{"x-ratelimit unix time", map[string][]string{
			"X-Ratelimit-Remaining": {"0"}, "X-Ratelimit-Reset": {"1700000030"},
		}, RateLimitInfo{Remaining: 0, HasRemaining: true, Reset: 30 * time.Second, HasReset: true}, true},
		{"x-ratelimit past unix time", map[string][]string{
			"X-Ratelimit-Remaining": {"0"}, "X-Ratelimit-Reset": {"1699999990"},
		}, RateLimitInfo{Remaining: 0, HasRemaining: true, Reset: 0, HasReset: true}, true},
		{"garbage ignored", map[string][]string{
			"RateLimit-Policy": {`"x";q=-1;w=10, 5;w=abc`}, "X-Ratelimit-Remaining": {"lots"}, "RateLimit": {"remaining=NaN"},
		}, RateLimitInfo{}, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := http.Header{}
			for k, vs := range c.headers {
				for _, v := range vs {
					h.Add(k, v)
				}
			}
			got, ok := ParseRateLimitHeaders(h, now)
			if got != c.want || ok != c.ok {
				t.Errorf("got %+v, %v; want %+v, %v", got, ok, c.want, c.ok)
			}
		})
	}
}

// policyUpstream is an in-memory API that announces a policy of quota
// requests per second and records when requests arrive.
type policyUpstream struct {
	mu        sync.Mutex
	quota     int
	remaining string // RateLimit remaining to announce, "" for none
	reset     string
	calls     []time.Duration
}

func (u *policyUpstream) RoundTrip(req *http.Request) (*http.Response, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.calls = append(u.calls, at())
	rec := httptest.NewRecorder()
	if u.quota > 0 {
		rec.Header().Set("RateLimit-Policy", `"default";q=`+formatInt(u.quota)+`;w=1`)
	}
	if u.remaining != "" {
		rec.Header().Set("X-RateLimit-Remaining", u.remaining)
		rec.Header().Set("X-RateLimit-Reset", u.reset)
	}
	rec.WriteHeader(http.StatusOK)
	return rec.Result(), nil
}

func (u *policyUpstream) gaps() []time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []time.Duration
	for i := 1; i < len(u.calls); i++ {
		out = append(out, u.calls[i]-u.calls[i-1])
	}
	return out
}

// A policy tighter than the configured limit paces every worker that
// learned it on one shared schedule in Redis, at LearnedMargin of the
// policy; a looser one never loosens the configured limit.
func TestTransportLearnsPolicy(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &policyUpstream{quota: 10}
		rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100).WithBurst(1)}
		a := newWorker(t, m, up, rule)
		b := newWorker(t, m, up, rule)
		// Each worker's first answer teaches it the policy.
		get(t, a, "http://api.example/")
		get(t, b, "http://api.example/")
		var wg sync.WaitGroup
		for range 5 {
			wg.Go(func() { get(t, a, "http://api.example/") })
			wg.Go(func() { get(t, b, "http://api.example/") })
		}
		wg.Wait()
		// 10 per second at 95%: one request per 105.263ms.
		want := learnedInterval(10)
		gaps := up.gaps()
		if len(gaps) != 11 {
			t.Fatalf("%d requests, want 12", len(gaps)+1)
		}
		// gaps[0] and [1] at the configured 10ms: the learned schedule
		// starts with the first request after an answer taught it.
		for i, g := range gaps[2:] {
			if g < want {
				t.Errorf("gap %d is %v; want at least %v (learned 10/s at %.0f%%)", i+3, g, want, LearnedMargin*100)
			}
		}
		if total := up.calls[len(up.calls)-1] - up.calls[1]; total > 11*want {
			t.Errorf("10 requests took %v; want about %v: the learned limit runs at its rate", total, 10*want)
		}
	})
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &policyUpstream{quota: 1000}
		a := newWorker(t, m, up, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		for range 5 {
			get(t, a, "http://api.example/")
		}
		for i, g := range up.gaps() {
			if g != 100*ms {
				t.Errorf("gap %d is %v; want the configured 100ms: a looser policy never loosens the limit", i+1, g)
			}
		}
	})
}

// A new, higher policy is followed as soon as an answer announces it, up
// to the configured limit; a lower one as soon too.
func TestTransportFollowsPolicyChange(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &policyUpstream{quota: 5}
		rdb := redistest.PipeClient(m)
		t.Cleanup(func() { _ = rdb.Close() })
		var learnedQuotas []int
		tr, err := New(mustNew(t, rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(50).WithBurst(1)}), Options{
			Base:    up,
			OnLearn: func(subject string, info RateLimitInfo) { learnedQuotas = append(learnedQuotas, info.Quota) },
		})
		if err != nil {
			t.Fatal(err)
		}
		a := &http.Client{Transport: tr}
		for range 3 {
			get(t, a, "http://api.example/")
		}
		up.mu.Lock()
		up.quota = 20
		up.mu.Unlock()
		for range 4 {
			get(t, a, "http://api.example/")
		}
		slow := learnedInterval(5)
		fast := learnedInterval(20)
		gaps := up.gaps()
		// gaps[0]: the configured 20ms (the learned schedule starts with
		// the request after the first answer). Then 5/s. The answer to
		// request 4 (sent at 5/s) announces 20/s: request 5 takes the
		// first slot of the fresh 20/s schedule at once (its configured
		// permit was free: request 4 took its own before it waited on the
		// learned schedule), then 20/s.
		want := []time.Duration{20 * ms, slow, slow, 0, fast, fast}
		for i := range want {
			if i < len(gaps) && (gaps[i]-want[i] > ms || want[i]-gaps[i] > ms) {
				t.Errorf("gap %d is %v, want %v (all gaps %v)", i+1, gaps[i], want[i], gaps)
			}
		}
		if fmt.Sprint(learnedQuotas) != "[5 20]" {
			t.Errorf("OnLearn saw quotas %v; want [5 20]: called when the learned limit changes", learnedQuotas)
		}
	})
}

// No request remaining until the reset pauses the subject for every
// worker until then.
func TestTransportRemainingZeroPauses(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &policyUpstream{remaining: "0", reset: "3"}
		rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)}
		a := newWorker(t, m, up, rule)
		b := newWorker(t, m, up, rule)
		get(t, a, "http://api.example/")
		up.mu.Lock()
		up.remaining = "" // no more to learn
		up.mu.Unlock()
		get(t, b, "http://api.example/")
		if len(up.calls) != 2 || up.calls[1] < 3*time.Second {
			t.Errorf("requests at %v; want the second (another worker) at 3s or later", up.calls)
		}
	})
}

// learnedInterval is the spacing a learned policy of perSecond gives.
func learnedInterval(perSecond float64) time.Duration {
	margin := LearnedMargin
	return time.Duration(float64(time.Second) / (perSecond * margin)).Round(time.Microsecond)
}

// Requests waiting on a learned schedule when an answer announces a
// faster one give their slots back and book on the new schedule, rather
// than going out at the old rate.
func TestTransportWaitersFollowFasterPolicy(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		up := &policyUpstream{quota: 5}
		a := newWorker(t, m, up, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100).WithBurst(1)})
		get(t, a, "http://api.example/") // learns 5/s
		up.mu.Lock()
		up.quota = 20
		up.mu.Unlock()
		start := at()
		var wg sync.WaitGroup
		for range 6 {
			wg.Go(func() { get(t, a, "http://api.example/") })
		}
		wg.Wait()
		// The first of the six goes at once and learns 20/s; at 5/s the
		// other five would take 5 × 210ms, at 20/s about 5 × 53ms.
		if took := up.calls[len(up.calls)-1] - start; took > 600*ms {
			t.Errorf("the six requests took %v (gaps %v); the waiters kept the old 5/s schedule", took, up.gaps())
		}
	})
}
