// Package httpthrottle paces outbound HTTP requests with a
// throttle.Limiter, and listens to what the upstream says about its own
// limit, for every process that shares the Limiter's Redis:
//
//	lim, _ := throttle.New(rdb, throttle.Options{}, throttle.Rule{
//		Name: "partner-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
//	tr, _ := httpthrottle.New(lim, httpthrottle.Options{})
//	client := &http.Client{Transport: tr}
//
// A request waits for a permit of the configured rules, then for its
// departure on the subject's upstream schedule (throttle.Upstream), and
// leaves. The schedule is what the upstream sees, and what the transport
// promises at it: a request leaves within throttle.DepartureTolerance of
// its slot (a fortieth of the interval, 2–5ms) or takes a new slot, also
// after a Redis stall, a process pause or a busy machine, so that late
// requests are spread instead of leaving together; once a rate is learned,
// one held up less than an interval leaves at once instead, and pushes
// the ones after it, each an interval after the one before (its slot
// would be a hole). A request whose headers reach the wire more than
// throttle.DepartureTolerance after its departure (a connection dialled
// first: a process's first request) records when (Stats.WroteLate), and
// the next leaves an interval after that. In any window of
// length W, at most burst + (W + tolerance) × rate requests leave: the
// configured rule's rate and burst while nothing is learned (at most
// limit + burst in any period of the rule), the learned rate with a burst
// of 1 once learned. Two exceptions, both counted: a request booked again
// three times for lateness leaves late (Stats.LeftLate), and the first
// request after nothing is known of the upstream leaves however late its
// slot came. What the upstream sees adds the variation of the path after
// the departure (the HTTP client, the network), which the schedule's 5 %
// room below a learned rate absorbs.
//
// What the upstream says is learned in Redis, for the whole fleet, from
// the first answer: every departure reads it in the script call that
// books it. An announced policy (RateLimit-Policy, or X-RateLimit-Limit
// over the longest reset seen) is a rate, followed at 95 % of it; the
// remaining requests and the reset describe one window (at most that many
// more until it resets), never a new rate. The first request after
// nothing is known of an upstream goes alone; the others wait for its
// answer, and the next leaves an interval after that answer.
//
// The 429 rule. A 429 lowers the learned rate for every process, and says
// so in a log line (Options.Logger) and in Stats.Lowered: from the rate its
// request was sent at, to 90 % of it near where the rate was meant to
// settle, to 80 % well under it, to half with no 429 before or well under
// the last one's rate (additive increase, multiplicative decrease, never
// above the configured rules); under an announced policy, a 429 alone (not
// the third within 1,000 requests) to 97 % of it, back in 0.3 s: a request
// that arrived late, not a rate too high. The limit of an upstream that
// announces nothing is discovered first, from the gaps between the requests
// it accepted and refused (throttle.Upstream: while the fleet discovers,
// every answer is learned, one more Redis call each, for about a second).
// The rate then recovers at 10 % of that rate a second to 98 % of it, and
// grows by 0.02 % a second past it, never above the announced policy: a
// steady fleet settles where the 429s stop. So a limit raised later is
// followed at once if the upstream announces it, and otherwise only at
// that pace (a tripled limit in about an hour and a half), or anew after
// the subject was idle for throttle.UpstreamTTL. From an upstream that announces
// nothing, once a 429 has lowered the rate, a 429 lowers it again only if
// another came within 200 requests before it: one alone is a request that
// arrived late, not a rate too high. An isolated 429 delays only its own
// request: its Retry-After is the caller's to wait (the worker's http
// handler defers its task by it). The subject is paused for every process
// (Limiter.PauseFor) only while no rate is learned, or when the 429 lowered
// the rate less than its Retry-After after the last lowering (the lowerings
// are not stopping the 429s); a 503's Retry-After, and a window with
// nothing left for a second or more, always pause it (see Transport).
//
// It is built only on throttle's public API. It imports throttle and the
// standard library, and nothing else of jobthrottle.
package httpthrottle

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Transport is an http.RoundTripper that paces outbound requests with a
// Limiter shared by every process that uses the same Redis (see the
// package doc).
//
// Before each request it waits for a permit of the request's subject (by
// default its host), as Limiter.Wait does: bounded by the request's
// context, refunded if that context ends first. Then it waits for the
// request's departure on the subject's upstream schedule
// (throttle.Upstream.Depart): at the learned rate, or the configured
// rules' while nothing is learned, after any pause, within the window the
// last answers described.
//
// A 429 Too Many Requests lowers the learned rate for every process. When
// the upstream answers 503 Service Unavailable with a Retry-After header
// (delta-seconds or an HTTP-date, RFC 9110 §10.2.3), the transport pauses
// the subject in Redis (PauseFor) for that long, capped at MaxPause: every
// worker on every machine then waits until the upstream's time, not just
// the one that was told. A 429's Retry-After pauses the subject so only
// when the schedule cannot be trusted to space the requests: while no
// rate is learned (nothing but the rules paces the fleet), or when the
// 429 lowered the rate less than its Retry-After after the last lowering
// (the 429s repeat although the rate went down; not while the limit of an
// upstream that announces nothing is discovered, whose 429s are the
// steps: see fleetPause). An isolated 429 under a
// learned rate, the usual see-saw of a fleet near its limit, lowers the
// rate and nothing more: its request alone waits out the Retry-After,
// which is the caller's to honour (the worker's http handler defers its
// task by it), while the others keep their slots on the slower schedule.
// A request that was already waiting for its departure when a pause came
// is booked again, after it.
//
// Every response's rate-limit headers are read too (ParseRateLimitHeaders)
// and, when they can change what the fleet knows, recorded in Redis
// (throttle.Upstream.Learn): one more round trip for that response only.
//
// The response is returned to the caller unchanged; the transport never
// retries by itself, so a request body is sent at most once. Retry at the
// caller (an asynq retry, say): the retry waits out the pause.
//
// A Transport is safe for concurrent use.
type Transport struct {
	lim      *throttle.Limiter
	up       *throttle.Upstream
	subject  func(*http.Request) string
	maxPause time.Duration
	maxWait  time.Duration
	base     http.RoundTripper
	onPause  func(subject string, d time.Duration, err error)
	onLearn  func(subject string, info RateLimitInfo)
	noWait   bool
	seen     *pacedSubjects // what each subject's upstream taught, lately
	paced    bool           // Options.Paced
	log      *slog.Logger
	stats    counters
}

// MaxPause is the longest pause Options.MaxPause may allow.
const MaxPause = 10 * 365 * 24 * time.Hour

// DefaultMaxPause caps the pause a Retry-After can cause when
// Options.MaxPause is zero. A longer Retry-After (an hourly
// quota, or a wrong header) pauses this long; the request after it then
// learns the rest.
const DefaultMaxPause = 10 * time.Minute

// pauseTimeout bounds the PauseFor and Learn calls a transport makes
// after an answer, which outlive the request's own context.
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
	// NoWait takes no permit of the configured rules: use it when the
	// caller already holds the permit (the worker middleware admitted the
	// task that sends the request, under the same limiter and subject).
	// The request still waits for its departure on the upstream schedule.
	NoWait bool
	// Paced, with NoWait, says that the caller's permit was a turn of
	// Limiter.Admit, which spaces the turns of a subject at its learned
	// upstream rate when that is slower than the rules' (the worker
	// middleware's turns). While the upstream has taught no rate, a
	// departure on the upstream schedule would only repeat those turns at
	// the rules' pace, and could push a request the rule admitted past
	// MaxLearnedWait: a paced request then leaves at once, without one
	// (the first to a subject, and one every PacedRecheck, still departs,
	// to learn what the fleet knows). Once a rate is learned, Admit books
	// the departure of each request it lets run at that rate in the same
	// call, at its turn: a request whose context carries the turn
	// (WithTurn, as the worker's http handler does) and that is sent
	// within an eighth of the learned interval of it (at least
	// throttle.DepartureTolerance) leaves then, with no departure of its
	// own (Stats.OnTurn), an interval after the latest request that left
	// (throttle.Upstream.Leave: one late for its turn holds the next
	// back); any other departs as without Paced, which keeps each one
	// within the tolerance of its slot at the upstream. A paced request
	// that leaves without a departure says so first (one call, which
	// reads the subject's pause): if a pause was recorded since its turn
	// was decided, it departs on the schedule, after the pause (or fails
	// with a *throttle.DelayError past MaxLearnedWait).
	Paced bool
	// MaxLearnedWait bounds how long a request waits for its departure on
	// the upstream schedule: a request whose departure is further away
	// fails at once with a *throttle.DelayError (Deadline false), nothing
	// consumed and nothing sent, so that a caller such as a job handler
	// can come back later instead of holding its worker. If zero, only
	// the request's context (and the limiter's MaxWait) bound the wait.
	MaxLearnedWait time.Duration
	// OnLearn, if set, is called when a response's rate-limit headers
	// change the policy learned for a subject. It must not block.
	OnLearn func(subject string, info RateLimitInfo)
	// Logger receives a warning each time a 429 lowers the rate learned
	// for a subject. If nil, slog.Default() is used.
	Logger *slog.Logger
}

// Stats are a Transport's counts since New, for metrics.
type Stats struct {
	// Sent is the requests handed to the base transport.
	Sent int64
	// TooMany is the answers 429 Too Many Requests.
	TooMany int64
	// Lowered is how many times an answer of this transport's lowered the
	// learned rate of a subject (each also logged).
	Lowered int64
	// Paused is the pauses this transport recorded (Retry-After, or a
	// window with nothing left).
	Paused int64
	// Rebooked is the departures booked again before their requests left
	// (throttle.Departure.Rebooked): a pause or a lowering voided them,
	// or they would have left late.
	Rebooked int64
	// OnTurn is the requests that left on their admitted turns, which
	// Limiter.Admit booked as their departures (Options.Paced, WithTurn),
	// with no departure of their own.
	OnTurn int64
	// LeftLate is the requests that left later than
	// throttle.DepartureTolerance after their slots, on a machine too busy
	// to leave in time.
	LeftLate int64
	// WroteLate is the requests whose headers reached the wire more than
	// throttle.DepartureTolerance after they left (a connection dialled
	// after the slot, a process held up): each told the fleet when
	// (throttle.Upstream.Left), so that the next request leaves an
	// interval after it.
	WroteLate int64
}

// counters are a Transport's Stats.
type counters struct{ sent, tooMany, lowered, paused, rebooked, onTurn, leftLate, wroteLate atomic.Int64 }

// Stats returns the transport's counts so far.
func (t *Transport) Stats() Stats {
	return Stats{Sent: t.stats.sent.Load(), TooMany: t.stats.tooMany.Load(), Lowered: t.stats.lowered.Load(),
		Paused: t.stats.paused.Load(), Rebooked: t.stats.rebooked.Load(), OnTurn: t.stats.onTurn.Load(), LeftLate: t.stats.leftLate.Load(),
		WroteLate: t.stats.wroteLate.Load()}
}

// LearnedRate returns the rate, in requests per second, that the fleet
// learned for the upstream of the subjects this transport sent requests
// for within RecentLearned: the slowest of them, as their last departure
// or answer here carried it. It is 0 while none of them taught a rate.
// It reads memory only: no Redis call.
func (t *Transport) LearnedRate() float64 { return t.seen.slowest(RecentLearned) }

var _ http.RoundTripper = (*Transport)(nil)

// New returns a Transport that waits on lim before each request.
// It returns an error if lim is nil or MaxPause is negative or above
// MaxPause, and a *throttle.ConfigError if lim has a concurrency rule and
// NoWait is not set.
func New(lim *throttle.Limiter, opts Options) (*Transport, error) {
	if lim == nil {
		return nil, errors.New("httpthrottle: New: nil Limiter")
	}
	if opts.MaxLearnedWait < 0 {
		return nil, &throttle.ConfigError{Field: "max_learned_wait", Reason: "must not be negative"}
	}
	if !opts.NoWait {
		for _, r := range lim.Rules() {
			if r.Algorithm == throttle.Concurrency {
				return nil, &throttle.ConfigError{Rule: r.Name, Field: "algorithm", Reason: "a concurrency rule's places are held until Release, which a Transport does not call; wait and release around the call yourself, and use NoWait"}
			}
		}
	}
	if opts.MaxPause < 0 || opts.MaxPause > MaxPause {
		return nil, &throttle.ConfigError{Field: "max_pause", Reason: "must be between 0 (the default, " + DefaultMaxPause.String() + ") and " + MaxPause.String()}
	}
	if opts.Paced && !opts.NoWait {
		return nil, &throttle.ConfigError{Field: "paced", Reason: "needs NoWait: only a caller that holds an admitted turn is paced by it"}
	}
	t := &Transport{lim: lim, up: lim.Upstream(), subject: opts.Subject, maxPause: opts.MaxPause, maxWait: opts.MaxLearnedWait,
		base: opts.Base, onPause: opts.OnPause, onLearn: opts.OnLearn, noWait: opts.NoWait, log: opts.Logger}
	t.seen, t.paced = &pacedSubjects{seen: map[string]pacedSubject{}}, opts.Paced
	if t.subject == nil {
		t.subject = hostSubject
	}
	if t.maxPause == 0 {
		t.maxPause = DefaultMaxPause
	}
	if t.base == nil {
		t.base = http.DefaultTransport
	}
	if t.log == nil {
		t.log = slog.Default()
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

// RoundTrip waits for a permit and for the request's departure, sends req
// through the base transport, and learns from the response. It returns
// the limiter's error (a *DelayError, ctx.Err(), an ErrRedis error…)
// without sending if the request could not leave, and closes the request
// body then, as a RoundTripper must.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	subject := t.subject(req)
	fail := func(err error) (*http.Response, error) {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	if !t.noWait {
		if err := t.lim.Wait(ctx, subject); err != nil {
			return fail(err)
		}
	}
	d, err := t.depart(ctx, subject)
	if err != nil {
		return fail(err)
	}
	t.stats.sent.Add(1)
	t.stats.rebooked.Add(int64(d.Rebooked))
	if d.Late > throttle.DepartureTolerance(d.Interval()) {
		t.stats.leftLate.Add(1)
	}
	resp, err := t.base.RoundTrip(t.traceWrite(req, subject, d))
	if err != nil {
		if d.Probe {
			// The fleet waits for the first answer: there is none.
			t.record(ctx, subject, d, throttle.Answer{})
		}
		return nil, err
	}
	t.listen(ctx, subject, d, resp)
	return resp, nil
}

// traceWrite returns req with a hook that notes when its headers reached
// the wire, if a rate is learned for it: one that did more than
// throttle.DepartureTolerance after its departure (a connection dialled
// after the slot: the first request of a process; a process held up)
// tells the fleet when, in the background, so that the next request
// leaves an interval after it rather than reaching the API closer than
// that.
func (t *Transport) traceWrite(req *http.Request, subject string, d *throttle.Departure) *http.Request {
	if d.Learned.Rate <= 0 || d.At.IsZero() {
		return req
	}
	left := d.At
	iv := d.Interval()
	if iv <= 0 {
		iv = time.Duration(float64(time.Second) / d.Learned.Rate)
	}
	// As late as a departure is let leave (throttle.DepartureTolerance:
	// half the room kept below the limit, 2 ms at least) is on time. A
	// fixed 1 ms was under a loaded machine's timer jitter: 121-298 calls
	// of Left in 1,500 requests at 3 workers, 7-18 at 10 (BENCHMARKS.md).
	late := throttle.DepartureTolerance(iv)
	var once sync.Once
	trace := &httptrace.ClientTrace{WroteHeaders: func() {
		wrote := time.Now()
		if wrote.Sub(left) <= late {
			return
		}
		once.Do(func() {
			t.stats.wroteLate.Add(1)
			ctx, cancel := context.WithTimeout(context.WithoutCancel(req.Context()), leftTimeout)
			go func() {
				defer cancel()
				_, _ = t.up.Left(ctx, subject, wrote)
			}()
		})
	}}
	return req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
}

// leftTimeout bounds the call that says a request reached the wire late:
// past its interval it would push nothing.
const leftTimeout = time.Second

// listen applies what a response says: what it teaches the fleet about
// the upstream's limit, and a pause for a window with nothing left for a
// second or more, or for a Retry-After when fleetPause says so.
func (t *Transport) listen(ctx context.Context, subject string, d *throttle.Departure, resp *http.Response) {
	now := serverNow(resp)
	tooMany := resp.StatusCode == http.StatusTooManyRequests
	if tooMany {
		t.stats.tooMany.Add(1)
	}
	info, _ := ParseRateLimitHeaders(resp.Header, now)
	retry := time.Duration(0)
	if tooMany || resp.StatusCode == http.StatusServiceUnavailable {
		if ra, ok := ParseRetryAfter(resp.Header.Get("Retry-After"), now); ok {
			retry = ra
		}
	}
	pause := time.Duration(0)
	if a := answer(info, false); info.HasRemaining && info.Remaining == 0 && info.HasReset && a.ResetMin >= time.Second {
		pause = a.ResetMin
	}
	lesson, learned := throttle.Lesson{}, false
	if tooMany || d.Probe || d.Learned.Discovering || informative(info, d.Learned) {
		lesson, learned = t.learn(ctx, subject, d, info, tooMany)
	}
	if retry > 0 && !tooMany {
		pause = max(pause, retry)
	} else if retry > 0 {
		pause = max(pause, fleetPause(lesson, learned, retry))
	}
	if pause > 0 {
		t.pauseFor(ctx, subject, pause)
	}
}

// fleetPause returns how long a 429 whose Retry-After is retry pauses
// every process (see Transport), given what Learn made of it (learned
// false if Learn failed); zero for no pause. The whole Retry-After when
// no rate is learned, so that nothing spaces the fleet's requests but the
// rules, or when the 429 lowered the rate within retry of the last
// lowering, so that the lowerings are not stopping the 429s. An isolated
// 429 under a learned rate only lowers it: its request waits its
// Retry-After alone (the caller's retry), and the schedule, slower now,
// goes on. While the limit of a resource that announces nothing is
// discovered (Lesson.Discovery), the 429s are its steps, each of
// which backs off by itself: the fleet pauses only for the least the
// Retry-After can mean, a second less than it says (whole seconds,
// rounded up: "1" is any wait under a second, which the slower schedule
// already keeps).
func fleetPause(l throttle.Lesson, learned bool, retry time.Duration) time.Duration {
	switch {
	case !learned || l.Rate <= 0:
		return retry
	case !l.Lowered || l.Since < 0 || l.Since >= retry:
		return 0
	case l.Discovery:
		return max(retry-time.Second, 0)
	}
	return retry
}

// depart returns req's departure: booked on the upstream schedule, or,
// for a paced request (Options.Paced), one that leaves now (leaveNow).
func (t *Transport) depart(ctx context.Context, subject string) (*throttle.Departure, error) {
	if t.paced {
		if d, ok := t.leaveNow(ctx, subject); ok {
			return d, nil
		}
	}
	depart := t.up.Depart
	if t.paced {
		depart = t.up.DepartPaced
	}
	d, err := depart(ctx, subject, t.maxWait)
	if err == nil {
		t.seen.saw(subject, d)
	}
	return d, err
}

// leaveNow returns a departure that leaves now, with no slot of its own,
// for a paced request (Options.Paced): on its turn, which Admit booked as
// its departure (WithTurn), or for a subject whose upstream taught no
// rate; false for any other, which departs on the schedule. Such a
// request says it leaves first (throttle.Upstream.Leave, one call): its
// turn was decided before it came, and a pause recorded meanwhile holds
// it back (false: Depart books it after the pause); and it leaves no
// sooner than the learned interval after the latest request (one late for
// its turn pushes it). A request that departs on the schedule makes no
// such call (Depart honours the pause and the latest leave): the call
// would make it late for the departure its turn may hold
// (throttle.DepartureTolerance), which it would then leave as a hole.
func (t *Transport) leaveNow(ctx context.Context, subject string) (*throttle.Departure, bool) {
	turn, _ := ctx.Value(turnKey{}).(Turn)
	ref := time.Now()
	if !t.seen.mayLeaveNow(subject, turn, ref) {
		return nil, false
	}
	// A failed call sends, as the worker's handler always has: Depart
	// would fail on the same Redis. A call that took longer than the
	// request may be late for its turn (Redis stalled, a starved process)
	// leaves all the same, at the leave it recorded: that is when the next
	// one may leave, so departing instead would leave a hole at the turn
	// (and book a slot behind every turn booked meanwhile), and the leaves
	// of requests held up together are spaced by the calls, one interval
	// each, in the order Redis ran them.
	// leave is the leave Redis recorded, on this clock: the request's At,
	// which its write is measured against (traceWrite), so that a reply
	// read late or a timer fired late on a busy machine counts as
	// lateness too (traced: requests that reached the API 3-5 ms after
	// the leave Redis recorded, their process held up around the call,
	// each a 429 for the next request).
	// The departure the call returns carries the leave on Redis's clock,
	// for Learn (while a limit is discovered, every answer is learned
	// with its leave), and whether the fleet is discovering.
	left, ok, err := t.up.LeaveDeparture(ctx, subject)
	if err == nil && !ok || ctx.Err() != nil {
		return nil, false // Depart fails with ctx's error
	}
	leave := time.Now()
	if err == nil {
		leave = left.At
	}
	if wait := time.Until(leave); wait > 0 {
		tm := time.NewTimer(wait)
		select {
		case <-tm.C:
		case <-ctx.Done():
			tm.Stop()
			return nil, false // Depart fails with ctx's error
		}
	}
	d, ok := t.seen.onTurn(subject, turn, ref)
	if ok {
		t.stats.onTurn.Add(1)
	} else if d, ok = t.seen.now(subject); !ok {
		return nil, false
	}
	if err != nil {
		d.At = leave
		return d, true
	}
	disc := left.Learned.Discovering
	left.Learned = d.Learned
	left.Learned.Discovering = disc
	return left, true
}

// serverNow is the time to read a response's dates against: the local
// clock, unless the response's Date is more than a couple of seconds off
// it (the clocks disagree): then the Date, so that only the server's own
// times are compared. The Date has whole seconds only, so it is not used
// where the local clock agrees with it: a reset at a Unix time would be a
// second off.
func serverNow(resp *http.Response) time.Time {
	now := time.Now()
	if date, err := http.ParseTime(resp.Header.Get("Date")); err == nil && (now.Sub(date) > 2*time.Second || date.Sub(now) > 2*time.Second) {
		return date
	}
	return now
}

// learn records an answer in Redis for the fleet, says what it changed,
// and returns what Learn made of it (false if it failed).
func (t *Transport) learn(ctx context.Context, subject string, d *throttle.Departure, info RateLimitInfo, tooMany bool) (throttle.Lesson, bool) {
	l, ok := t.record(ctx, subject, d, answer(info, tooMany))
	if !ok {
		return l, false
	}
	if l.Lowered {
		t.stats.lowered.Add(1)
		t.log.Warn("httpthrottle: the upstream answered 429 Too Many Requests; the learned rate is lowered for every process",
			"subject", subject, "from_per_second", round3(l.From), "to_per_second", round3(l.Rate), "policy", policyText(l.Learned))
	}
	if l.Changed && t.onLearn != nil {
		t.onLearn(subject, info)
	}
	return l, true
}

// record is Learn on a context that outlives the request's.
func (t *Transport) record(ctx context.Context, subject string, d *throttle.Departure, a throttle.Answer) (throttle.Lesson, bool) {
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pauseTimeout)
	defer cancel()
	l, err := t.up.Learn(lctx, subject, d, a)
	if err == nil {
		t.seen.learned(subject, l.Learned)
	}
	if err != nil {
		t.log.Error("httpthrottle: what the upstream answered could not be recorded in Redis", "subject", subject, "error", err)
		return l, false
	}
	return l, true
}

func round3(f float64) string { return strconv.FormatFloat(f, 'f', 3, 64) }

// policyText describes a learned policy for logs: "20 per 1s", or "none".
func policyText(l throttle.Learned) string {
	if l.Window <= 0 {
		return "none"
	}
	return strconv.Itoa(l.Quota) + " per " + l.Window.String()
}

// pauseFor pauses subject for d, capped at MaxPause, for every worker.
func (t *Transport) pauseFor(ctx context.Context, subject string, d time.Duration) {
	d = min(d, t.maxPause)
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pauseTimeout)
	defer cancel()
	_, err := t.lim.PauseFor(pctx, subject, d)
	if err == nil {
		t.stats.paused.Add(1)
	}
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
