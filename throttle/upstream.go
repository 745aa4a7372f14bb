package throttle

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// An Upstream is where a limiter's requests meet the resource behind it
// (an HTTP API with a limit of its own, which it may announce, or only
// enforce): the schedule on which the requests of each subject leave, and
// what the fleet has learned of that resource's limit. Both are kept in
// Redis, in one hash per subject and limiter,
// <prefix>{<subject>}:!upstream(<rules>), beside the departures booked at
// a learned rate, <prefix>{<subject>}:!departures(<rules>) (a sorted set),
// for UpstreamTTL after their last use, and read in the same script call
// that books a departure: what one process learned paces the next
// departure of every process.
//
// Depart books a request's departure and returns when it may leave;
// Learn records what the resource answered to it. Package httpthrottle
// does both for HTTP requests.
//
// # The schedule
//
// Departures are spaced at the learned rate with no burst: each is booked
// at the first slot at least 1/rate from every departure booked (they are
// booked out of their order: Admit books turns' departures up to its
// caller's wait ahead). While nothing is learned, they are spaced at the
// limiter's slowest rule (its interval and burst); they come after the subject's
// pause (PauseFor), and within the last window an answer described (at
// most Remaining more until its reset). A departure leaves within the
// tolerance of its slot, on the Redis clock and on the local one, or not
// at all: a departure whose slot passed while Redis was stalled, the
// process was paused or the machine was busy is booked again instead of
// leaving late beside the next one, and so is one that waited while the
// subject was paused or the learned rate was lowered. So catching up
// after a stall is spread at the schedule's rate, and in any window of
// length W at most burst + (W + tolerance) × rate departures leave, the
// tolerance being a fortieth of the interval, at least 2ms and at most
// 5ms (see DepartureTolerance).
//
// # Learning
//
// An announced policy (Quota per Window) is a rate: the schedule starts at
// LearnedShare (95 %) of it, or of the limiter's slowest rule if that is
// slower. A limit without a window (X-RateLimit-Limit) is a policy over
// the longest reset seen, rounded up to whole seconds. Remaining and the
// reset describe one window, not a rate: at most Remaining more
// departures until the window resets (before its earliest possible reset
// when a policy is known, else its latest); they never change the rate.
//
// An answer that the resource is over its limit (TooMany, an HTTP 429)
// lowers the learned rate, once per lowering: 429s to departures booked
// before the last lowering are not counted again. It is lowered from the
// rate the resource saw (the one the departure was booked at; without a
// learned rate, the rate departures have been leaving at; never above
// the slowest rule): to 90 % of it when the 429 came near the rate of
// the last one (the usual see-saw of a fleet at its limit); to 80 % when
// it came well under it (under 95 %: the limit is lower than thought); to
// half when it came under 70 % of it, or with no 429 before and no
// policy. It then recovers at 10 % a second of the rate the 429 came at,
// to 98 % of it, and past that grows by 0.02 % a second: slowly towards the
// policy (never above it, nor above the slowest rule), so that a steady
// fleet settles where the 429s stop. A resource that announces nothing
// refuses a rate above its limit again and again, and one under it only
// now and then (a request that reached it late, closer than its limit to
// the next): so, once a 429 has lowered the rate, a 429 lowers it again
// only if another came within 200 departures before it; one alone lowers
// nothing. Under a policy every 429 lowers the rate, but one alone (not
// the third within 1,000 departures: more than 0.2 %) only to 97 % of the
// rate it came at, and it recovers to that rate, not to 98 % of it, in
// 0.3 s: the room kept below the policy is for such late requests, one of
// them (or two, 300 departures apart) would otherwise hold the fleet 2 %
// lower for good, and lowered by a tenth the fleet ran under 95 % of the
// limit for the second after one (BENCHMARKS.md). The third within 1,000
// is lowered as any, for good.
//
// A resource that announces nothing is discovered first
// (Learned.Discovering, from its first answer until its limit is found):
// every answer, 200s too, is learned with when its request left. A resource
// with no burst accepts a request no sooner than its interval T after the
// last one it accepted, so the answers in the order they left bound T: at
// most the least gap between two accepted requests, more than the largest
// gap from an accepted request to a refused one after it. A 429 with no
// accepted pair after it doubles the interval from that gap; with both
// bounds, the interval tries their midpoint (a bisection), each step's rate
// held until its answers judge it, and turns and paced departures are
// booked no more than two intervals ahead, 100 ms at least (Limiter.Admit,
// DepartPaced), so that a step applies within that; once the bounds are
// within 10 % of each other the rate is found: 1/(1.05 × the upper bound),
// 86-97 % of the limit, held there, and a 429 from then on is answered as
// above. The requests sent while discovering, 429s too, count against the
// rate found: the next leaves no sooner than each of them plus as many
// intervals as requests left from it on. The fleet found a 20/s limit under
// a 100/s rule with 2-6 429s and converged within a second in 20 of 24 runs
// of 3 and 10 worker processes, 1.006-1.19 s in the other four, each a 429
// late in the first second or just after the limit was found
// (BENCHMARKS.md), where halving on 429s and recovering took 2.4-3.3 s.
// Discovery ends with nothing found when the bounds disagree (a resource
// with a burst or a window: its 429s are then answered as above, halving
// the rate at first) or when 20 answers came with no 429 (the rules bind,
// not the resource).
//
// # Admissions
//
// Limiter.Admit reads the same state in its call (lua/upstream_pace.lua):
// while the learned rate is slower than a gcra or token_bucket rule's,
// that rule's turns are decided at the learned rate with a burst of 1,
// and no sooner than the latest departure's slot and an interval. So a
// backlog parks on turns the resource accepts. A caller that runs on such
// a turn (granted, or its booking redeemed) takes its request's departure
// in the same call: on its own turn (now, if the turn passed) when no
// departure is booked within an interval of it, else at the next slot
// that is, if that is at most an interval later; and Admit's delay is
// until it. Its request then leaves with no departure of its own (DepartNow),
// after Leave, which reads the pause and holds it back to 98 % of the
// learned interval after the latest request that left (what the resource sees is
// when requests leave: one late for its turn pushes the next instead of
// coming closer to it), or, later for its turn than its caller allows
// (httpthrottle: an eighth of the interval, at least DepartureTolerance),
// departs as any other (Depart, whose departures keep the same interval
// after it). A
// redeemed booking whose departure would be later still (a turn booked at
// a faster pace, before the rate was learned or lowered, that late
// departures have overtaken) is not redeemed: its caller takes a new
// turn. Other callers of the rule (Allow, Reserve, Wait) keep its own
// rate. For 3 s after a rate is first learned, a process may not know yet
// that Admit booked its turn as its request's departure, and departs on
// the schedule: Depart's first booking then hands it that departure, if
// one booked by Admit lies within DepartureTolerance ahead of now or less
// than the learned interval behind it (its owner late), instead of a
// second slot (the first would leave a hole); not if it lies closer than
// the learned interval to another departure (booked at a faster pace,
// before a lowering). One claimed late leaves at once, an interval after
// the latest leave at the soonest; so does a departure whose confirmation
// comes less than an interval after its slot (its process held up): the
// departures after it are pushed, as behind a late owner.
//
// The first departure after nothing is known of the resource (a new
// subject, or its state expired) probes: the others wait for its answer,
// at most probeWait, so that they do not all learn the limit by being
// refused; the next departure leaves an interval after that answer at the
// soonest (the probe may have reached the resource as late as its answer
// came: on a cold connection, well after its slot).
type Upstream struct {
	lim      *Limiter
	interval float64 // the slowest rule's interval, µs; 0 if no rule sets a rate
	burst    int
}

// UpstreamTTL is how long an Upstream's state (the schedule and what was
// learned) is kept after the last call that used it.
const UpstreamTTL = 10 * time.Minute

// probeWait bounds how long an Upstream's departures wait for the answer
// to the first one, when nothing is known of the resource.
const probeWait = 2 * time.Second

// LearnedShare is the share of an announced policy an Upstream's
// schedule starts at: the rest is room for the jitter of departures and
// arrivals, which an upstream with no burst answers with 429s.
const LearnedShare = 0.95

// The learning controller (see Upstream): the first four are the
// upstream scripts' ARGV (lua/upstream_state.lua); the growth, which admit
// applies too (lua/upstream_pace.lua), is written in lua/upstream_rate.lua,
// and the lowering by a 429 alone in lua/upstream_learn.lua (k_alone): a
// test checks that they say the same as learnBelow, learnRecover,
// learnGrow and learnAlone.
const (
	learnStart    = LearnedShare
	learnGentle   = 0.9    // lowering by a 429 near the rate meant to settle at
	learnLower    = 0.8    // lowering by a 429 well under it
	learnDiscover = 0.5    // lowering while discovering
	learnBelow    = 0.98   // the share of the rate a 429 came at to recover to
	learnRecover  = 0.1    // recovery per second, a share of that rate
	learnGrow     = 0.0002 // growth per second past it
	learnAlone    = 0.97   // lowering by a 429 alone under a policy
)

// confirmAfter is how long a departure may wait for its slot and still
// leave without asking Redis again: a longer wait gives a pause or a
// lowering time to come. Those that ask do so confirmLead before the
// slot (a pause or a lowering in the last confirmLead is not seen).
const (
	confirmAfter = 5 * time.Millisecond
	confirmLead  = 5 * time.Millisecond
)

// comeBackMax bounds how long a departure that Redis tells to come back
// sleeps before it asks again: Redis says when (lua/upstream_state.lua:
// within 20 ms while the first answer is awaited; while a limit is
// discovered, at the departure's place in line), this only bounds it.
const comeBackMax = probeWait

// operations of the upstream scripts (lua/upstream_<op>.lua), named in
// errors
const (
	opDepart  op = "depart"
	opConfirm op = "confirm"
	opLearn   op = "learn"
	opCancel  op = "cancel"
	opLeave   op = "leave"
	opLeft    op = "left"
)

// upstreamScripts are one script per operation, lua/upstream_<op>.lua
// after the state they share (lua/upstream_state.lua); each documents its
// ARGV and reply.
var upstreamScripts = map[op]*redis.Script{}

var upstreamOps = []op{opDepart, opConfirm, opLearn, opCancel, opLeave, opLeft}

func init() {
	for _, o := range upstreamOps {
		upstreamScripts[o] = buildScript("upstream_rate.lua", "upstream_state.lua", "upstream_"+string(o)+".lua")
	}
}

const (
	upstreamSuffix   = "!upstream"
	departuresSuffix = "!departures"
)

// Upstream returns the schedule and learned state of l's requests to the
// resource behind it. Its ceiling is l's slowest rate rule (a
// Concurrency rule sets none): the learned rate never passes it, and
// while nothing is learned departures are paced at it, with its burst (a
// window rule's burst is its Count).
func (l *Limiter) Upstream() *Upstream {
	l.upLoad.Do(l.loadUpstream)
	u := &Upstream{lim: l, burst: 1}
	for _, r := range l.rules {
		if r.Algorithm.spec().holders {
			continue
		}
		iv := float64(r.Limit.Period.Microseconds()) / float64(r.Limit.Count)
		if iv > u.interval {
			u.interval, u.burst = iv, r.Limit.Burst
			if !r.Algorithm.bucket() {
				u.burst = r.Limit.Count
			}
		}
	}
	return u
}

// loadUpstream loads the upstream scripts in the background, once a
// limiter has an Upstream: loaded on first use instead, a process's first
// departure would reach Redis a round trip (SCRIPT LOAD) late, and that
// departure is often the one Admit booked for its turn (see Upstream),
// which it claims late, pushing the departures after it. A failure is
// left to the first call, which loads the script again. It does not take
// the lock a first call loads under (runner.load): a call is never held up
// behind it, at the cost of loading a script twice if they meet.
func (l *Limiter) loadUpstream() {
	l.bg.start(func() { // not after Close
		ctx, cancel := context.WithTimeout(l.bg.context(), probeWait)
		defer cancel()
		for _, o := range upstreamOps {
			l.loadUnlocked(ctx, upstreamScripts[o])
		}
	})
}

// keys are the script's KEYS for subject, which has passed encodeSubject.
func (u *Upstream) keys(subject string) []string {
	p := u.lim.policy
	return []string{p.upstreamKey(subject), p.pauseKey(subject), p.departuresKey(subject)}
}

// upstreamKey is subject's upstream hash under this limiter's rules, which
// Admit reads too (lua/upstream_pace.lua).
func (p *policy) upstreamKey(subject string) string {
	return key(p.prefix, escape(subject), upstreamSuffix+"("+strings.Join(p.keyRules, ",")+")")
}

// departuresKey is subject's departures booked at a learned rate under
// this limiter's rules (lua/upstream_rate.lua), which Admit books into
// too.
func (p *policy) departuresKey(subject string) string {
	return key(p.prefix, escape(subject), departuresSuffix+"("+strings.Join(p.keyRules, ",")+")")
}

// args are the script's ARGV for o, before the operation's own.
func (u *Upstream) args(o op, extra ...any) []any {
	a := []any{string(o), strconv.FormatFloat(u.interval, 'f', -1, 64), u.burst, UpstreamTTL.Milliseconds(),
		learnStart, learnGentle, learnLower, learnDiscover}
	return append(a, extra...)
}

// Learned is what the fleet has learned of a resource's limit.
type Learned struct {
	// Rate is the learned rate, requests per second; 0 while none is
	// learned (departures then follow the limiter's slowest rule).
	Rate float64
	// Quota requests per Window: the policy the resource announced, or
	// inferred from a limit and the longest reset seen. Both zero if none.
	Quota  int
	Window time.Duration
	// Discovering reports that the fleet is finding the limit of a
	// resource that announces nothing (see Upstream): every answer,
	// accepted or not, is worth a Learn until it is found.
	Discovering bool
}

// A Departure is a request's slot on its subject's upstream schedule,
// taken by Depart, which returns at it.
type Departure struct {
	// At is when the request may leave, on the local monotonic clock: the
	// slot Redis booked.
	At time.Time
	// Probe reports that this is the first departure since nothing was
	// known of the resource: the other departures wait for its answer, so
	// give Learn one (an empty Answer if none came).
	Probe bool
	// Learned is what the fleet knew of the resource when the slot was
	// booked.
	Learned Learned
	// Late is how long after its slot the departure left, as this
	// process maps the Redis clock: at most DepartureTolerance, unless it
	// was booked again maxLate times for being later (a machine too busy
	// to leave in time).
	Late time.Duration
	// Rebooked counts the slots this departure was booked at before the
	// one it left at: voided by a pause or a lowering, or passed.
	Rebooked int

	booked   int64         // Redis time (µs) of the call that booked it; -1 if unknown
	leave    int64         // Redis time (µs) it was to leave at, Late not counted; 0 if unknown
	seq      int64         // its number on the schedule; -1 if unknown
	interval time.Duration // the spacing it was booked at; 0: none
	slot     string        // the slot, µs of Redis time, as the script wrote it
	gen      int64         // the lowerings before it was booked
	tat      [2]string     // the schedule's end before and after it was booked
	last     string        // the latest slot before it was booked ("" if none)
	delay    time.Duration // from the booking to when it leaves: its slot, or pushed
	pushed   time.Duration // how long after its slot it was booked to leave (a turn's, claimed late or behind a late leave)
	est      time.Time     // the slot's local time, unclamped (redisClock.slot)
}

// DepartNow returns a departure that leaves now without a slot on the
// schedule: for a request sent on a turn that Limiter.Admit already spaced
// at the learned rate (lua/upstream_pace.lua). Learned is what the caller
// last knew of the resource. Learn takes it as a departure whose booking
// is unknown.
func DepartNow(l Learned) *Departure {
	now := time.Now()
	return &Departure{At: now, est: now, Learned: l, booked: -1, seq: -1}
}

// Leave is called as a request of subject leaves with no departure of its
// own (DepartNow): on a turn Limiter.Admit booked as its departure. In one
// call it reads the subject's pause and records the leave. It returns
// false if the subject is paused: the request then departs on the
// schedule (Depart), which waits for the pause's end. Else it returns how
// long the request must still wait: what the resource sees is when
// requests leave, so a request leaves no sooner than 98 % of the learned
// interval after the latest one left (a request on its turn, or a
// departure at its slot), whatever their turns: a request late for its
// turn pushes the next by its lateness (past a fiftieth of the interval)
// instead of leaving it closer to it; a request pushed by more than half
// an interval (queued behind another's push: every request after a
// stall) leaves a whole interval after the latest. A request whose wait ctx cuts short
// must not leave. While no rate is learned it only reads the pause. A
// Redis failure is an error matching ErrRedis (the pause is not known).
func (u *Upstream) Leave(ctx context.Context, subject string) (time.Duration, bool, error) {
	at, ok, err := u.LeaveAt(ctx, subject)
	if !ok || err != nil {
		return 0, ok, err
	}
	return max(time.Until(at), 0), true, nil
}

// LeaveAt is Leave, and returns when the request leaves on this process's
// clock instead of how long it waits: the leave Redis recorded, mapped
// through the clock its replies keep (a reply read late does not make the
// request later still). A caller that measures how late its request
// reached the wire compares with it (httpthrottle: Left).
func (u *Upstream) LeaveAt(ctx context.Context, subject string) (time.Time, bool, error) {
	d, ok, err := u.LeaveDeparture(ctx, subject)
	if !ok || err != nil {
		return time.Time{}, ok, err
	}
	return d.At, true, nil
}

// LeaveDeparture is LeaveAt, and returns the request's departure to give
// Learn with its answer: At the leave, and of Learned only Discovering
// (the fleet's now; the rest is the caller's to fill with what it knew).
// Learn counts it as a departure whose booking is unknown (DepartNow's)
// that left at At.
func (u *Upstream) LeaveDeparture(ctx context.Context, subject string) (*Departure, bool, error) {
	if _, err := encodeSubject(subject); err != nil {
		return nil, false, err
	}
	raw, recv, err := u.call(ctx, u.keys(subject), u.args(opLeave))
	if err != nil {
		return nil, false, u.lim.result(ctx, opLeave, err)
	}
	if len(raw) != 4 {
		return nil, false, fmt.Errorf("throttle: upstream: unexpected reply %v", raw)
	}
	if replyInt(raw[0]) == 1 {
		return nil, false, nil
	}
	// The subjects a limiter over several charges too (PauseFor reads
	// them all).
	for _, p := range u.lim.mode.parts() {
		if p.lim == u.lim && p.of(subject) == subject {
			continue
		}
		left, err := p.lim.pause(ctx, p.of(subject), 0)
		if err != nil {
			return nil, false, err
		}
		if left > 0 {
			return nil, false, nil
		}
	}
	wait, now := replyInt(raw[1]), replyInt(raw[2])
	at := u.lim.clock.wake(recv, now, time.Duration(wait)*time.Microsecond)
	l := Learned{Discovering: replyInt(raw[3]) == 1}
	return &Departure{At: at, est: at, Learned: l, booked: -1, seq: -1, leave: now + wait}, true, nil
}

// Left records that a request of subject reached the wire at at (the
// local clock), later than the departure or Leave that let it go: a
// connection dialled after its slot, a process held up. What the resource
// sees is when requests arrive, so the next departure or leave is pushed
// to an interval after at, instead of coming closer than that to it. Call
// it only for such a request (httpthrottle does, when its headers were
// written more than DepartureTolerance after it left, the lateness a
// departure is let leave with): one call each. It reports
// whether at is now the latest leave known (false if a later one was, or
// no rate is learned). A Redis failure is an error matching ErrRedis.
func (u *Upstream) Left(ctx context.Context, subject string, at time.Time) (bool, error) {
	if _, err := encodeSubject(subject); err != nil {
		return false, err
	}
	raw, _, err := u.call(ctx, u.keys(subject), u.args(opLeft, max(time.Since(at), 0).Microseconds()))
	if err != nil {
		return false, u.lim.result(ctx, opLeft, err)
	}
	return len(raw) == 1 && replyInt(raw[0]) == 1, nil
}

// Interval is the spacing the departure was booked at: the learned
// rate's, or the ceiling's while nothing is learned; 0 if nothing paced it.
func (d *Departure) Interval() time.Duration { return d.interval }

// DepartureTolerance is how late a departure booked at interval may
// leave: a fortieth of the interval, at least 2ms and at most 5ms;
// without an interval (nothing paces the departures) a second. A
// fortieth is half the room a schedule at LearnedShare of an upstream's
// rate keeps before the next departure (the other half is for what
// follows: the HTTP client, the network, the upstream's own clock); 2ms
// is about what a busy machine's timers and scheduler make a departure
// late by (BENCHMARKS.md): tighter, its departures would be booked again
// so often that the holes they leave in the schedule cost a tenth of the
// rate.
func DepartureTolerance(interval time.Duration) time.Duration {
	if interval <= 0 {
		return time.Second
	}
	return min(max(interval/40, 2*time.Millisecond), 5*time.Millisecond)
}

// Depart books the next departure of a request of subject and returns
// when the request may leave: at its slot, within DepartureTolerance of
// it. A departure that would leave later (its reply, or this goroutine,
// was held up), or whose wait a pause or a lowering of the learned rate
// overtook, is booked again; one that a request leaving before it (late
// for its own turn, Leave) came closer to than the learned interval is
// pushed to an interval after that leave instead, keeping its place in the
// schedule; after maxLate such re-bookings in a row for
// lateness on the local clock alone (a machine so loaded that no reply
// comes back in time) it leaves late rather than never. While the limit
// of a resource that announces nothing is discovered
// (Learned.Discovering), a departure more than an interval away is not
// booked: Depart asks again nearer to it, so that each interval tried
// holds from the next departure on, at a place in line Redis gives it (an
// interval after the departure given the place before), so that the
// departures waiting come back one at a time, not all at once; one whose
// place would make it leave past its bound fails at once.
//
// The wait is bounded by ctx's deadline, by the limiter's MaxWait and by
// maxWait if above zero: a slot past the tightest fails at once with a
// *DelayError, nothing booked (matching context.DeadlineExceeded if the
// deadline was the bound). If ctx ends while waiting, the slot is given
// back as far as no later departure was booked behind it, and ctx.Err()
// returned. A Redis failure is an error matching ErrRedis, unless the
// limiter fails open: the request then leaves at once.
func (u *Upstream) Depart(ctx context.Context, subject string, maxWait time.Duration) (*Departure, error) {
	return u.depart(ctx, subject, maxWait, true)
}

// DepartPaced is Depart for a request sent on a turn that Limiter.Admit
// spaced at the learned rate (httpthrottle's Options.Paced): while a limit
// is discovered, its departure is booked where the schedule puts it up to
// as far ahead as Admit books turns then (two intervals, at least 100 ms),
// instead of Depart's asking again until it is an interval away. Admit's
// turns keep the pace the discovery tries already; asking again would cost
// a call an interval for every such request (measured: 0.4 more depart
// calls a task at 10 worker processes). Turns admitted before a rate was
// learned, at the rules' pace, do ask again: booked wherever the schedule
// put them, ten of them held a faster step back 0.7 s.
func (u *Upstream) DepartPaced(ctx context.Context, subject string, maxWait time.Duration) (*Departure, error) {
	return u.depart(ctx, subject, maxWait, false)
}

// depart is Depart; near asks again for a departure more than an
// interval away while a limit is discovered.
func (u *Upstream) depart(ctx context.Context, subject string, maxWait time.Duration, near bool) (*Departure, error) {
	if _, err := encodeSubject(subject); err != nil {
		return nil, err
	}
	keys := u.keys(subject)
	var d *Departure
	rebooked, late := 0, 0
	for {
		if d == nil {
			var err error
			// Only the first booking may claim the departure of the
			// caller's turn: a re-booking is late for it.
			if d, err = u.book(ctx, keys, maxWait, rebooked == 0, near); err != nil || d.seq < 0 {
				return d, err
			}
		}
		// Confirmed a little before the slot, so that the round trip
		// does not make it late.
		if err := sleep(ctx, time.Until(d.At.Add(-confirmLead))); err != nil {
			u.giveBack(ctx, keys, d)
			return nil, err
		}
		next, err := u.confirm(ctx, keys, d, maxWait)
		if err != nil || next != d {
			// Booked again by Redis (void), or failed.
			d, rebooked = next, rebooked+1
			if err != nil || d.seq < 0 {
				return d, err
			}
			continue
		}
		if err := sleep(ctx, time.Until(d.At)); err != nil {
			u.giveBack(ctx, keys, d)
			return nil, err
		}
		// The probe leaves however late: nothing left before it, and the
		// others wait for its answer.
		d.Late = max(time.Since(d.est), 0)
		if d.Late <= DepartureTolerance(d.interval) || late >= maxLate || d.Probe {
			d.Rebooked = rebooked
			return d, nil
		}
		late++
		rebooked++
		d = nil
	}
}

// maxLate bounds the re-bookings of one Depart for lateness seen only on
// the local clock.
const maxLate = 3

// book books a departure, waiting while the first departure's answer is
// awaited, or, while a limit is discovered, until the place in line
// Redis gives a departure it may not book yet (lua/upstream_state.lua:
// disc_ahead_wait). If claim, the departure may be one Admit booked for the
// caller's turn near now (lua/upstream_rate.lua: up_claim): a request
// sent on its turn from a process that did not know yet that the turn
// was its departure. Not after waiting for the first answer: the turn
// was then not at a learned rate.
func (u *Upstream) book(ctx context.Context, keys []string, maxWait time.Duration, claim, near bool) (*Departure, error) {
	place := "0" // where it comes back in the line while a limit is discovered
	for {
		bound, byDeadline := u.bound(ctx, maxWait)
		raw, recv, err := u.call(ctx, keys, u.args(opDepart, micros(bound), probeWait.Microseconds(), boolArg(claim), boolArg(near), place))
		if err != nil {
			return u.failed(ctx, opDepart, err)
		}
		d, wait, err := u.departure(raw, recv, byDeadline)
		if err != nil || d != nil {
			return d, err
		}
		if p := replyText(raw[2]); p != "" {
			place = p
		}
		claim = false
		if err := sleep(ctx, wait); err != nil {
			return nil, err
		}
	}
}

// confirm asks Redis whether a departure that waited for its slot still
// stands: it returns d if it does (or if it did not wait long enough to
// need asking), else the departure booked instead.
func (u *Upstream) confirm(ctx context.Context, keys []string, d *Departure, maxWait time.Duration) (*Departure, error) {
	if d.delay <= confirmAfter {
		return d, nil
	}
	bound, byDeadline := u.bound(ctx, maxWait)
	late := DepartureTolerance(d.interval)
	raw, recv, err := u.call(ctx, keys, u.args(opConfirm, micros(bound), probeWait.Microseconds(),
		d.slot, d.gen, late.Microseconds(), d.tat[0], d.tat[1], d.last))
	if err != nil {
		return u.failed(ctx, opConfirm, err)
	}
	if len(raw) == 2 {
		// It stands, pushed by the lateness of a request that left before
		// it (lua/upstream_confirm.lua): by what it was not pushed already.
		if push := time.Duration(replyInt(raw[1])) * time.Microsecond; push > d.pushed {
			d.At, d.est = d.At.Add(push-d.pushed), d.est.Add(push-d.pushed)
			d.leave += (push - d.pushed).Microseconds()
			d.pushed = push
		}
		return d, nil
	}
	next, wait, err := u.departure(raw, recv, byDeadline)
	if err != nil || next != nil {
		return next, err
	}
	// The first departure's answer is awaited again (the state expired
	// while this one waited).
	if err := sleep(ctx, wait); err != nil {
		return nil, err
	}
	return u.book(ctx, keys, maxWait, false, false)
}

// giveBack cancels a departure that will not leave: the schedule's end
// moves back if no later departure was booked behind it.
func (u *Upstream) giveBack(ctx context.Context, keys []string, d *Departure) {
	cctx, cancel := ownTimeout(context.WithoutCancel(ctx), refundTimeout)
	defer cancel()
	_, _, _ = u.call(cctx, keys, u.args(opCancel, d.tat[0], d.tat[1], d.last, d.slot))
}

// bound is how long a departure may wait: the tighter of maxWait (if
// above zero) and the limiter's (Limiter.waitBound), and whether ctx's
// deadline is the tightest.
func (u *Upstream) bound(ctx context.Context, maxWait time.Duration) (time.Duration, bool) {
	bound, byDeadline := u.lim.waitBound(ctx, time.Now())
	if maxWait > 0 && (bound < 0 || maxWait < bound) {
		return maxWait, false
	}
	return bound, byDeadline
}

// call runs one call of the script and returns its reply and when it came.
func (u *Upstream) call(ctx context.Context, keys []string, args []any) ([]any, time.Time, error) {
	cmd := u.lim.run(ctx, upstreamScripts[op(args[0].(string))], evalLine(keys, args))
	recv := time.Now()
	if err := cmd.Err(); err != nil {
		return nil, recv, err
	}
	u.lim.redisOK()
	if n, ok := cmd.Val().(int64); ok {
		return []any{n}, recv, nil
	}
	raw, err := cmd.Slice()
	return raw, recv, err
}

// failed answers a departure whose call to Redis failed: at once if the
// limiter fails open, else an error matching ErrRedis.
func (u *Upstream) failed(ctx context.Context, o op, err error) (*Departure, error) {
	err = deadlineCause(ctx, err)
	if u.lim.redisFailed(ctx, err) {
		now := time.Now()
		return &Departure{At: now, est: now, booked: -1, seq: -1}, nil
	}
	return nil, &redisError{op: o, err: err}
}

// departure decodes a depart or confirm reply (lua/upstream_*.lua): the
// departure booked, or how long to wait for the first answer, or a
// *DelayError if the slot is too far.
func (u *Upstream) departure(raw []any, recv time.Time, byDeadline bool) (*Departure, time.Duration, error) {
	if len(raw) != 15 {
		return nil, 0, fmt.Errorf("throttle: upstream: unexpected reply %v", raw)
	}
	status, _ := raw[0].(int64)
	delay := time.Duration(replyInt(raw[1])) * time.Microsecond
	switch status {
	case 2:
		return nil, min(max(delay, time.Millisecond), comeBackMax), nil
	case 0:
		return nil, 0, &DelayError{Rule: "upstream", RetryAfter: delay, Deadline: byDeadline}
	}
	now := replyInt(raw[5])
	at, est := u.lim.clock.slot(recv, now, delay)
	d := &Departure{
		At:       at,
		est:      est,
		Probe:    replyInt(raw[12]) == 1,
		booked:   now,
		seq:      replyInt(raw[3]),
		gen:      replyInt(raw[4]),
		slot:     replyText(raw[2]),
		tat:      [2]string{replyText(raw[6]), replyText(raw[7])},
		interval: time.Duration(replyInt(raw[8])) * time.Microsecond,
		delay:    delay,
		last:     replyText(raw[13]),
		leave:    now + delay.Microseconds(),
	}
	if slot, err := strconv.ParseInt(d.slot, 10, 64); err == nil && now+delay.Microseconds() > slot {
		d.pushed = time.Duration(now+delay.Microseconds()-slot) * time.Microsecond
	}
	d.Learned = learned(raw[9], raw[10], raw[11], raw[14])
	return d, 0, nil
}

// learned decodes the rate (text, empty for none) and policy of a reply.
func learned(rate, quota, window, discovering any) Learned {
	l := Learned{Quota: int(replyInt(quota)), Window: time.Duration(replyInt(window)) * time.Microsecond,
		Discovering: replyInt(discovering) == 1}
	l.Rate, _ = strconv.ParseFloat(replyText(rate), 64)
	return l
}

func replyInt(v any) int64 {
	n, _ := v.(int64)
	return n
}

func replyText(v any) string {
	s, _ := v.(string)
	return s
}

// An Answer is what the resource said to a departure's request, as Learn
// reads it. The zero value says nothing (but that an answer came).
type Answer struct {
	// TooMany reports that the resource refused the request as over its
	// limit (HTTP 429).
	TooMany bool
	// Quota requests per Window: a policy the resource announced. Both
	// zero if none.
	Quota  int
	Window time.Duration
	// Limit is a quota whose window the resource does not name
	// (X-RateLimit-Limit): Learn takes the window as the longest reset
	// seen, rounded up to whole seconds. Zero if none.
	Limit int
	// Remaining more requests until the reset, if HasRemaining.
	Remaining    int
	HasRemaining bool
	// The window resets between ResetMin and ResetMax from now, if
	// HasReset: a reset in whole seconds n is [n−1s, n], a Unix time or a
	// fraction names the moment (ResetMin = ResetMax).
	ResetMin, ResetMax time.Duration
	HasReset           bool
}

// A Lesson is what Learn made of an answer.
type Lesson struct {
	// Learned is the fleet's knowledge after the answer.
	Learned
	// Lowered reports that the answer (a 429) lowered the learned rate,
	// from From requests per second to Learned.Rate.
	Lowered bool
	From    float64
	// Changed reports that the answer changed the policy.
	Changed bool
	// Since is how long before this answer the learned rate was last
	// lowered (by a 429 or a slower policy); negative if it never was. A
	// 429 that lowers the rate soon after the last lowering says that
	// the lowering did not stop the 429s.
	Since time.Duration
	// Discovery reports that the answer was a step of discovering the
	// limit of a resource that announces nothing (see Upstream), the last
	// one too: each step backs off by itself, so a 429 of it is no sign
	// that the lowerings are not stopping the 429s.
	Discovery bool
}

// Learn records what the resource answered to d's request (d may be nil
// when the request left without a departure): a policy, a window, a 429
// (see Upstream). It is one script call; it returns an error matching
// ErrRedis if Redis fails.
func (u *Upstream) Learn(ctx context.Context, subject string, d *Departure, a Answer) (Lesson, error) {
	if _, err := encodeSubject(subject); err != nil {
		return Lesson{}, err
	}
	booked, seq, iv, left := int64(-1), int64(-1), int64(0), int64(-1)
	if d != nil {
		booked, seq, iv = d.booked, d.seq, d.interval.Microseconds()
		if d.leave > 0 {
			left = d.leave + d.Late.Microseconds()
		}
	}
	tooMany := 0
	if a.TooMany {
		tooMany = 1
	}
	remaining, rmin, rmax := int64(-1), int64(-1), int64(-1)
	if a.HasRemaining {
		remaining = int64(a.Remaining)
	}
	if a.HasReset {
		rmin, rmax = max(a.ResetMin, 0).Microseconds(), max(a.ResetMax, a.ResetMin, 0).Microseconds()
	}
	quota, window := int64(a.Quota), a.Window.Microseconds()
	if quota <= 0 || window <= 0 {
		quota, window = 0, 0
	}
	raw, _, err := u.call(ctx, u.keys(subject), u.args(opLearn, tooMany, booked, seq, quota, window,
		int64(max(a.Limit, 0)), remaining, rmin, rmax, iv, left))
	if err != nil {
		err = u.lim.result(ctx, opLearn, err)
		return Lesson{}, err
	}
	if len(raw) != 9 {
		return Lesson{}, fmt.Errorf("throttle: upstream: unexpected reply %v", raw)
	}
	l := Lesson{Learned: learned(raw[2], raw[4], raw[5], raw[7]), Lowered: replyInt(raw[0]) == 1, Changed: replyInt(raw[3]) == 1,
		Since: time.Duration(replyInt(raw[6])) * time.Microsecond, Discovery: replyInt(raw[8]) == 1}
	l.From, _ = strconv.ParseFloat(replyText(raw[1]), 64)
	return l, nil
}

func boolArg(b bool) int {
	if b {
		return 1
	}
	return 0
}
