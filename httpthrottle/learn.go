package httpthrottle

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// RateLimitInfo is what a response's rate-limit headers say about the
// upstream's limit. The zero value says nothing.
type RateLimitInfo struct {
	// Quota requests per Window: the upstream's policy. Both zero if the
	// response names no window (X-RateLimit-Limit alone does not).
	Quota  int
	Window time.Duration
	// Remaining requests until Reset, if HasRemaining.
	Remaining    int
	HasRemaining bool
	// Reset is how long until Remaining is restored, if HasReset.
	Reset    time.Duration
	HasReset bool
}

// ParseRateLimitHeaders reads the rate-limit fields of a response:
//
//   - the IETF RateLimit and RateLimit-Policy fields
//     (draft-ietf-httpapi-ratelimit-headers): the structured form
//     `RateLimit-Policy: "default";q=100;w=10` with `RateLimit:
//     "default";r=42;t=7`, the dictionary form `RateLimit: limit=100,
//     remaining=42, reset=7` with `RateLimit-Policy: 100;w=10`, and the
//     separate RateLimit-Limit, -Remaining and -Reset fields;
//   - the common X-RateLimit-Limit, X-RateLimit-Remaining and
//     X-RateLimit-Reset, whose reset is seconds from now or, when it is
//     beyond a billion, a Unix time (read against now, the response's
//     Date when it has one).
//
// Of several policies it keeps the slowest (least quota per second), of
// several remaining counts the least. Values that do not parse are
// ignored. It reports false if nothing was learned.
func ParseRateLimitHeaders(h http.Header, now time.Time) (RateLimitInfo, bool) {
	var info RateLimitInfo
	remaining := func(n int, reset time.Duration, hasReset bool) {
		if !info.HasRemaining || n < info.Remaining {
			info.Remaining, info.HasRemaining = n, true
			if hasReset {
				info.Reset, info.HasReset = reset, true
			}
		} else if hasReset && !info.HasReset {
			info.Reset, info.HasReset = reset, true
		}
	}
	policy := func(q int, w time.Duration) {
		if q <= 0 || w <= 0 {
			return
		}
		if info.Window == 0 || float64(q)/w.Seconds() < float64(info.Quota)/info.Window.Seconds() {
			info.Quota, info.Window = q, w
		}
	}

	for _, v := range h.Values("RateLimit-Policy") {
		for _, it := range sfItems(v) {
			w, okW := seconds(it.params["w"])
			if q, ok := nonNegInt(it.params["q"]); ok && okW { // "name";q=100;w=10
				policy(q, w)
			} else if q, ok := nonNegInt(it.value); ok && okW { // 100;w=10
				policy(q, w)
			}
		}
	}
	for _, v := range h.Values("RateLimit") {
		dict := map[string]string{}
		for _, it := range sfItems(v) {
			if r, ok := nonNegInt(it.params["r"]); ok { // "name";r=42;t=7
				t, okT := seconds(it.params["t"])
				remaining(r, t, okT)
				continue
			}
			if k, val, ok := strings.Cut(it.value, "="); ok { // limit=100, remaining=42, reset=7
				dict[strings.ToLower(strings.TrimSpace(k))] = strings.TrimSpace(val)
			}
		}
		if r, ok := nonNegInt(dict["remaining"]); ok {
			t, okT := seconds(dict["reset"])
			remaining(r, t, okT)
		}
	}
	for _, prefix := range []string{"RateLimit-", "X-RateLimit-"} {
		r, okR := nonNegInt(firstItem(h.Get(prefix + "Remaining")))
		if !okR {
			continue
		}
		t, okT := resetIn(firstItem(h.Get(prefix+"Reset")), now)
		remaining(r, t, okT)
	}
	learned := info.Window > 0 || info.HasRemaining
	return info, learned
}

// sfItem is one member of a structured-field list: its value and its
// parameters, parsed loosely (quotes dropped, keys lower case).
type sfItem struct {
	value  string
	params map[string]string
}

// sfItems splits a field value into its comma-separated members and each
// member's ';' parameters.
func sfItems(v string) []sfItem {
	var out []sfItem
	for member := range strings.SplitSeq(v, ",") {
		parts := strings.Split(member, ";")
		it := sfItem{value: strings.Trim(strings.TrimSpace(parts[0]), `"`), params: map[string]string{}}
		for _, p := range parts[1:] {
			k, val, _ := strings.Cut(p, "=")
			it.params[strings.ToLower(strings.TrimSpace(k))] = strings.Trim(strings.TrimSpace(val), `"`)
		}
		out = append(out, it)
	}
	return out
}

// firstItem is the first member of a list value, without parameters:
// "100, 100;w=60" gives "100".
func firstItem(v string) string {
	v, _, _ = strings.Cut(v, ",")
	v, _, _ = strings.Cut(v, ";")
	return strings.TrimSpace(v)
}

func nonNegInt(s string) (int, bool) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	return n, err == nil && n >= 0
}

// seconds reads a non-negative number of seconds, whole or decimal.
func seconds(s string) (time.Duration, bool) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) || f > MaxPause.Seconds() {
		return 0, false
	}
	return time.Duration(f * float64(time.Second)), true
}

// unixTimeFloor tells a Unix time from delta seconds in X-RateLimit-Reset.
const unixTimeFloor = 1_000_000_000

// resetIn reads a reset: delta seconds, or a Unix time.
func resetIn(s string, now time.Time) (time.Duration, bool) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, false
	}
	if f >= unixTimeFloor {
		d := time.Unix(0, int64(f*1e9)).Sub(now)
		return max(d, 0), d <= MaxPause
	}
	return seconds(s)
}

// LearnedMargin is the share of a learned rate a Transport uses, so that
// arrival jitter does not push requests over the upstream's limit.
const LearnedMargin = 0.95

// learnedTTL is how long a learned limit holds without a response
// repeating it.
const learnedTTL = time.Minute

// maxLearned bounds the subjects a Transport remembers limits for.
const maxLearned = 1024

// learnedRule names the schedule learned for a subject at one interval:
// its key is <prefix>{<subject>}:~learned-<interval in µs>. Rules files
// cannot name a rule with '~'. A schedule per interval means that a new
// limit starts from a fresh schedule rather than behind the bookings made
// at the old rate; every process that learned the same limit shares it.
func learnedRule(interval time.Duration) string {
	return "~learned-" + strconv.FormatInt(interval.Microseconds(), 10)
}

// learned is the limit learned for one subject: a GCRA limiter in the
// same Redis, so that every process that learned it shares one schedule.
type learned struct {
	lim      *throttle.Limiter
	interval time.Duration
	until    time.Time
	replaced chan struct{} // closed when another schedule replaces this one
}

// learner holds a Transport's learned limits, by subject.
type learner struct {
	mu         sync.Mutex
	bySubject  map[string]*learned
	configured time.Duration // the configured limit's interval per request, once known (knowConfigured)
	maxWait    time.Duration // Options.MaxLearnedWait
}

func newLearner(maxWait time.Duration) *learner {
	return &learner{bySubject: map[string]*learned{}, maxWait: maxWait}
}

// knowConfigured reads the configured limit's interval once, from the
// state read the limiter answers for subject (AllowN of 0): the interval
// of the rule it reports. With several rules that may be a faster one
// than the slowest, which only keeps a learned limit that the slowest
// rule would have made redundant: never one that loosens anything.
func (l *learner) knowConfigured(ctx context.Context, lim *throttle.Limiter, subject string) {
	l.mu.Lock()
	known := l.configured > 0
	l.mu.Unlock()
	if known {
		return
	}
	res, err := lim.AllowN(ctx, subject, 0)
	if err != nil || res.Limit.Count < 1 {
		return
	}
	l.mu.Lock()
	l.configured = res.Limit.Period / time.Duration(res.Limit.Count)
	l.mu.Unlock()
}

// get returns what was learned for subject, or nil.
func (l *learner) get(subject string, now time.Time) *learned {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.bySubject[subject]
	if e == nil {
		return nil
	}
	if now.After(e.until) {
		l.drop(subject)
		return nil
	}
	return e
}

// wait takes a slot of subject's learned schedule, if there is one. A
// request waiting for its slot when an answer replaces the schedule
// gives the slot back and books one on the new schedule: requests booked
// at the old rate would otherwise go out at it, over a lower limit or
// late for a higher one.
func (l *learner) wait(ctx context.Context, subject string) error {
	e := l.get(subject, time.Now())
	for e != nil {
		r, err := l.reserve(ctx, e.lim, subject)
		if err != nil {
			return err
		}
		timer := time.NewTimer(r.Delay())
		select {
		case <-timer.C:
			return nil
		case <-e.replaced:
			timer.Stop()
			l.cancel(ctx, r)
			e = l.get(subject, time.Now())
		case <-ctx.Done():
			timer.Stop()
			l.cancel(ctx, r)
			return ctx.Err()
		}
	}
	return nil
}

// reserve books a slot on a learned schedule, bounded by MaxLearnedWait
// as well as by ctx: past it, a *throttle.DelayError whose Deadline is
// false (the bound is the transport's, not the caller's deadline).
func (l *learner) reserve(ctx context.Context, lim *throttle.Limiter, subject string) (*throttle.Reservation, error) {
	rctx, byMax := ctx, false
	if l.maxWait > 0 {
		if dl, ok := ctx.Deadline(); !ok || time.Until(dl) > l.maxWait {
			var cancel context.CancelFunc
			rctx, cancel = context.WithTimeout(ctx, l.maxWait)
			defer cancel()
			byMax = true
		}
	}
	r, err := lim.ReserveN(rctx, subject, 1)
	var de *throttle.DelayError
	if byMax && errors.As(err, &de) && de.Deadline {
		return nil, &throttle.DelayError{Rule: de.Rule, RetryAfter: de.RetryAfter}
	}
	return r, err
}

// cancel gives a learned slot back, after ctx may have ended.
func (l *learner) cancel(ctx context.Context, r *throttle.Reservation) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pauseTimeout)
	defer cancel()
	_ = r.Cancel(cctx)
}

// drop forgets subject's entry, waking its waiters. l.mu is held.
func (l *learner) drop(subject string) {
	if e := l.bySubject[subject]; e != nil {
		close(e.replaced)
		delete(l.bySubject, subject)
	}
}

// set records that subject allows one request per interval; an interval
// no longer than the configured limit's forgets what was learned (the
// configured limit is never loosened, so it is enough).
func (l *learner) set(base *throttle.Limiter, subject string, interval time.Duration, now time.Time) (changed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.bySubject[subject]
	if interval <= l.configured {
		if e != nil {
			l.drop(subject)
			return true
		}
		return false
	}
	interval = interval.Round(time.Microsecond)
	if e != nil && e.interval == interval {
		e.until = now.Add(learnedTTL)
		return false
	}
	lim, err := base.With(throttle.Rule{Name: learnedRule(interval), Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: interval, Burst: 1}})
	if err != nil {
		return false
	}
	if e == nil && len(l.bySubject) >= maxLearned {
		for s, old := range l.bySubject {
			if now.After(old.until) {
				l.drop(s)
			}
		}
		for s := range l.bySubject {
			if len(l.bySubject) < maxLearned {
				break
			}
			l.drop(s)
		}
	}
	if e != nil {
		close(e.replaced)
	}
	l.bySubject[subject] = &learned{lim: lim, interval: interval, until: now.Add(learnedTTL), replaced: make(chan struct{})}
	return true
}

// learn applies what resp's headers say for subject: a policy, or the
// remaining requests over the time to reset, becomes a learned limit if
// it is tighter than the configured one; none remaining pauses the
// subject until the reset, for every worker.
func (t *Transport) learn(ctx context.Context, subject string, resp *http.Response) {
	now := time.Now()
	if date, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
		now = date
	}
	info, ok := ParseRateLimitHeaders(resp.Header, now)
	if !ok {
		return
	}
	if info.HasRemaining && info.Remaining == 0 && info.HasReset && info.Reset > 0 &&
		resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		t.pauseFor(ctx, subject, info.Reset)
	}
	var perSecond float64
	switch {
	case info.Window > 0:
		perSecond = float64(info.Quota) / info.Window.Seconds()
	case info.HasRemaining && info.HasReset && info.Reset >= time.Second && info.Remaining > 0:
		perSecond = float64(info.Remaining) / info.Reset.Seconds()
	default:
		return
	}
	if perSecond <= 0 {
		return
	}
	interval := time.Duration(float64(time.Second) / (perSecond * LearnedMargin))
	if interval > MaxPause {
		interval = MaxPause
	}
	t.learner.knowConfigured(ctx, t.lim, subject)
	if t.learner.set(t.lim, subject, interval, time.Now()) && t.onLearn != nil {
		t.onLearn(subject, info)
	}
}
