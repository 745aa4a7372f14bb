// Package httpthrottle paces outbound HTTP requests with a throttle.Limiter
// and listens to what the upstream says about its limits: it pauses a
// subject for every process on 429 and 503 with Retry-After, and learns a
// slower limit from rate-limit headers.
//
// It is built only on throttle's public API. It imports throttle and the
// standard library, and nothing else of jobthrottle.
package httpthrottle

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Transport is an http.RoundTripper that paces outbound requests with a
// Limiter shared by every process that uses the same Redis:
//
//	lim, _ := throttle.New(rdb, throttle.Options{}, throttle.Rule{
//		Name: "partner-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
//	tr, _ := httpthrottle.New(lim, httpthrottle.Options{})
//	client := &http.Client{Transport: tr}
//
// Before each request it waits for a permit of the request's subject (by
// default its host), as Limiter.Wait does: bounded by the request's
// context, refunded if that context ends first.
//
// When the upstream answers 429 Too Many Requests or 503 Service
// Unavailable with a Retry-After header (delta-seconds or an HTTP-date, RFC
// 9110 §10.2.3), the transport pauses the subject in Redis (PauseFor) for
// that long, capped at MaxPause: every worker on every machine then waits
// until the upstream's time, not just the one that was told. A request
// whose slot was booked before the pause (it was already waiting) checks
// the pause once more before it is sent (one more round trip) and, if
// paused, books a new slot after it.
//
// Every response's rate-limit headers are read too (ParseRateLimitHeaders:
// the IETF RateLimit and RateLimit-Policy fields, X-RateLimit-Limit,
// -Remaining and -Reset). A policy (or, without one, the remaining
// requests over the time to reset) slower than the configured limit
// becomes a learned limit for the subject: a GCRA schedule at
// LearnedMargin of that rate, kept in Redis under
// <prefix>{<subject>}:~learned-<interval µs>, so that every process that
// learned it shares one schedule (requests waiting when another limit is
// learned give their slots back and book on the new schedule); requests then wait on it as well as on the
// configured limit. A learned limit never loosens the configured one, is
// replaced by each answer that announces another, and is forgotten a
// minute after the last answer that repeated it. None remaining before
// the reset pauses the subject until the reset, for every worker.
//
// The response is returned to the caller unchanged; the transport never
// retries by itself, so a request body is sent at most once. Retry at the
// caller (an asynq retry, say): the retry waits out the pause.
//
// A Transport is safe for concurrent use.
type Transport struct {
	lim      *throttle.Limiter
	subject  func(*http.Request) string
	maxPause time.Duration
	base     http.RoundTripper
	onPause  func(subject string, d time.Duration, err error)
	onLearn  func(subject string, info RateLimitInfo)
	noWait   bool
	learner  *learner
}

// MaxPause is the longest pause Options.MaxPause may allow.
const MaxPause = 10 * 365 * 24 * time.Hour

// DefaultMaxPause caps the pause a Retry-After can cause when
// Options.MaxPause is zero. A longer Retry-After (an hourly
// quota, or a wrong header) pauses this long; the request after it then
// learns the rest.
const DefaultMaxPause = 10 * time.Minute

// pauseTimeout bounds the PauseFor call a transport makes after a 429,
// which outlives the request's own context.
const pauseTimeout = 5 * time.Second

// Options configure a Transport. The zero value limits by host,
// caps pauses at DefaultMaxPause and sends through http.DefaultTransport.
type Options struct {
	// Subject names what a request counts against. If nil, the request's
	// host and port (URL.Host, else Host) is used. An empty subject fails
	// the request with an error matching ErrInvalidSubject.
	Subject func(*http.Request) string
	// MaxPause caps the pause taken from a Retry-After. If zero,
	// DefaultMaxPause is used. At most MaxPause (the constant).
	MaxPause time.Duration
	// Base sends the requests. If nil, http.DefaultTransport is used.
	Base http.RoundTripper
	// OnPause, if set, is called after a response paused a subject for d,
	// with the error from Redis if the pause could not be recorded. Use it
	// for logs and metrics; it must not block.
	OnPause func(subject string, d time.Duration, err error)
	// NoWait sends each request at once, without taking a permit, and
	// only listens to the responses (pauses on 429 and 503). Use it when
	// the caller already holds the permit: the worker middleware admitted
	// the task that sends the request, under the same limiter and subject.
	NoWait bool
	// MaxLearnedWait bounds how long a request waits for its slot on a
	// learned limit: a request whose slot is further away fails at once
	// with a *throttle.DelayError (Deadline false), nothing consumed and
	// nothing sent, so that a caller such as a job handler can come back
	// later instead of holding its worker. If zero, only the request's
	// context bounds the wait.
	MaxLearnedWait time.Duration
	// OnLearn, if set, is called when a response's rate-limit headers
	// change the limit learned for a subject. It must not block.
	OnLearn func(subject string, info RateLimitInfo)
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that waits on lim before each request.
// It returns an error if lim is nil or MaxPause is negative or above
// MaxPause.
func New(lim *throttle.Limiter, opts Options) (*Transport, error) {
	if lim == nil {
		return nil, errors.New("httpthrottle: New: nil Limiter")
	}
	if opts.MaxLearnedWait < 0 {
		return nil, &throttle.ConfigError{Field: "max_learned_wait", Reason: "must not be negative"}
	}
	if opts.MaxPause < 0 || opts.MaxPause > MaxPause {
		return nil, &throttle.ConfigError{Field: "max_pause", Reason: "must be between 0 (the default, " + DefaultMaxPause.String() + ") and " + MaxPause.String()}
	}
	t := &Transport{lim: lim, subject: opts.Subject, maxPause: opts.MaxPause, base: opts.Base, onPause: opts.OnPause, onLearn: opts.OnLearn, noWait: opts.NoWait, learner: newLearner(opts.MaxLearnedWait)}
	if t.subject == nil {
		t.subject = hostSubject
	}
	if t.maxPause == 0 {
		t.maxPause = DefaultMaxPause
	}
	if t.base == nil {
		t.base = http.DefaultTransport
	}
	return t, nil
}

// hostSubject is the default subject: the request's host[:port].
func hostSubject(req *http.Request) string {
	if req.URL != nil && req.URL.Host != "" {
		return req.URL.Host
	}
	return req.Host
}

// RoundTrip waits for a permit, sends req through the base transport, and
// pauses the subject if the response says so. It returns the limiter's
// error (a *DelayError, ctx.Err(), an ErrRedis error…) without sending if
// no permit could be had, and closes the request body then, as a
// RoundTripper must.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	subject := t.subject(req)
	if t.noWait {
		if err := checkSubject(subject); err != nil {
			if req.Body != nil {
				_ = req.Body.Close()
			}
			return nil, err
		}
	} else if err := t.wait(ctx, subject); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	// The upstream may have said it allows less than the configured limit.
	if err := t.learner.wait(ctx, subject); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	resp, err := t.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
		t.pause(ctx, subject, resp)
	}
	t.learn(ctx, subject, resp)
	return resp, nil
}

// checkSubject fails a NoWait request whose subject the limiter would
// refuse, before it is sent.
func checkSubject(s string) error {
	if s == "" {
		return fmt.Errorf("%w: empty; the request names no host", throttle.ErrInvalidSubject)
	}
	return nil
}

// waitedAlone is how long a Wait may take and still count as decided on
// the spot (one round trip): a longer one slept for a slot booked ahead.
const waitedAlone = 5 * time.Millisecond

// wait takes one permit for subject. A slot booked ahead may have been
// overtaken by a pause while this request slept: then the permit is spent
// (its slot has passed) and a new one is booked, after the pause.
func (t *Transport) wait(ctx context.Context, subject string) error {
	for {
		start := time.Now()
		if err := t.lim.Wait(ctx, subject); err != nil {
			return err
		}
		if time.Since(start) < waitedAlone {
			return nil // decided just now, after any pause
		}
		left, err := t.lim.PauseFor(ctx, subject, 0)
		if err != nil || left <= 0 {
			// A permit is held; failing to learn of a pause must not
			// cost the request.
			return nil
		}
	}
}

// pause records the pause a 429 or 503 asks for, if its Retry-After
// parses. An HTTP-date is read against the response's own Date when it
// has one, so the local clock does not matter.
func (t *Transport) pause(ctx context.Context, subject string, resp *http.Response) {
	now := time.Now()
	if date, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
		now = date
	}
	d, ok := ParseRetryAfter(resp.Header.Get("Retry-After"), now)
	if !ok || d <= 0 {
		return
	}
	t.pauseFor(ctx, subject, d)
}

// pauseFor pauses subject for d, capped at MaxPause, for every worker.
func (t *Transport) pauseFor(ctx context.Context, subject string, d time.Duration) {
	d = min(d, t.maxPause)
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pauseTimeout)
	defer cancel()
	_, err := t.lim.PauseFor(pctx, subject, d)
	if t.onPause != nil {
		t.onPause(subject, d, err)
	}
}

// maxDeltaSeconds is what a delta-seconds too large to represent counts
// as: 2^31 seconds (about 68 years), as RFC 9111 §1.2.2 asks of caches.
const maxDeltaSeconds = 1 << 31

// ParseRetryAfter parses the value of a Retry-After header (RFC 9110
// §10.2.3) into how long to wait from now. It accepts delta-seconds (a
// non-negative decimal integer; values above 2^31 count as 2^31 seconds)
// and an HTTP-date in any of the three formats RFC 9110 §5.6.7 requires
// (IMF-fixdate, RFC 850, asctime); a date at or before now gives 0.
// Surrounding spaces and tabs are ignored. Anything else, including an
// empty value, a sign, a fraction or a zone other than GMT, reports
// false.
//
// now is the reference for dates: the response's Date header when there
// is one (so that the two server times are compared), else time.Now().
func ParseRetryAfter(h string, now time.Time) (time.Duration, bool) {
	h = strings.Trim(h, " \t")
	if h == "" {
		return 0, false
	}
	if isDigits(h) {
		secs, err := strconv.ParseUint(h, 10, 64)
		if err != nil || secs > maxDeltaSeconds { // only overflow fails here
			secs = maxDeltaSeconds
		}
		return time.Duration(secs) * time.Second, true
	}
	when, err := http.ParseTime(h)
	if err != nil {
		return 0, false
	}
	// http.ParseTime reads the RFC 850 form's zone as any abbreviation;
	// HTTP dates are GMT (asctime's ends in the year instead).
	if last := h[strings.LastIndexAny(h, " \t")+1:]; last != "GMT" && !isDigits(last) {
		return 0, false
	}
	d := when.Sub(now) // saturates rather than overflows
	if d < 0 {
		d = 0
	}
	return d, true
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
