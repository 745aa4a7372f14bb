package main

import (
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// The header styles the learn part's fake API answers in (learn.go).
const (
	styleIETF       = "ietf"        // RateLimit-Policy and RateLimit, structured form
	styleXSeconds   = "x-ratelimit" // X-RateLimit-Limit/-Remaining/-Reset, reset in seconds
	styleXUnix      = "x-unix"      // the same, reset as a Unix time
	styleRetryAfter = "retry-after" // no rate-limit headers: 429 with Retry-After only
	// styleRuleOnly is an API with no limit of its own (and no headers):
	// the fleet's rule, at the API's L, is the only limit, so the case
	// measures pacing at send time alone (issue 19's stall at 20/s burst 1).
	styleRuleOnly = "rule-only"
)

// limitedAPI is a third-party API with a limit its callers are not told:
// L requests a second, burst 1 (a GCRA with no tolerance: a request less
// than 1/L after the last accepted one is refused), answering 429 with
// Retry-After (whole seconds, rounded up) past it. Its rate-limit headers
// describe the calendar second a request falls in: L per 1 s, the
// requests it accepted in it so far, and when it ends.
type limitedAPI struct {
	start    time.Time
	interval time.Duration
	limit    int
	style    string

	mu   sync.Mutex
	tat  time.Duration // the earliest time, since start, the next request is accepted
	sec  int64         // the Unix second of used
	used int           // requests accepted in Unix second sec
	hits []apiHit
}

func newLimitedAPI(limit int, style string) *limitedAPI {
	interval := time.Second / time.Duration(limit)
	if style == styleRuleOnly {
		interval = 0
	}
	return &limitedAPI{start: time.Now(), interval: interval, limit: limit, style: style}
}

func (a *limitedAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	d := now.Sub(a.start)
	a.mu.Lock()
	ok := d >= a.tat
	if ok {
		a.tat = max(a.tat, d) + a.interval
	}
	wait := a.tat - d
	if s := now.Unix(); s != a.sec {
		a.sec, a.used = s, 0
	}
	if ok {
		a.used++
	}
	remaining := max(a.limit-a.used, 0)
	end := time.Unix(a.sec+1, 0)
	a.hits = append(a.hits, apiHit{at: d, ok: ok})
	a.mu.Unlock()

	a.headers(w.Header(), remaining, now, end)
	if !ok {
		w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(wait.Seconds())))))
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// headers writes the style's rate-limit fields: the calendar second's
// quota, what is left of it, and its end.
func (a *limitedAPI) headers(h http.Header, remaining int, now, end time.Time) {
	secs := strconv.Itoa(int(math.Ceil(end.Sub(now).Seconds())))
	l, r := strconv.Itoa(a.limit), strconv.Itoa(remaining)
	switch a.style {
	case styleIETF:
		h.Set("RateLimit-Policy", `"default";q=`+l+`;w=1`)
		h.Set("RateLimit", `"default";r=`+r+`;t=`+secs)
	case styleXSeconds:
		h.Set("X-RateLimit-Limit", l)
		h.Set("X-RateLimit-Remaining", r)
		h.Set("X-RateLimit-Reset", secs)
	case styleXUnix:
		h.Set("X-RateLimit-Limit", l)
		h.Set("X-RateLimit-Remaining", r)
		h.Set("X-RateLimit-Reset", strconv.FormatInt(end.Unix(), 10))
	}
}

// log returns every request the API saw, in arrival order.
func (a *limitedAPI) log() []apiHit {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]apiHit(nil), a.hits...)
}
