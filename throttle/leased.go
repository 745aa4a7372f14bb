package throttle

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Leased mode (Options.LocalLease): one hot key beyond one Redis shard.
// The package doc ("One hot key: local runs of turns") states what it does and
// the bound on over-admission; this file is how.
//
// A leased subject in this process is a leasedKey: its leases (runs of
// slots granted by one 'reserve' of k permits, the same script and state
// as the exact path), the slots cancelled waits gave back, the requests
// queued for a lease call under way, and its demand. Slot i of a lease of
// k lies on the Redis clock at the reservation's ticket (the exact time to
// act of its last permit) less k - 1 - i intervals, and never before the
// Redis now of the grant; leaseClock maps it onto the local clock as an
// interval [lo, hi] that contains it. A permit is handed out no earlier
// than hi and no later than lo + δ; expire drops the slots past that.
//
// Requests are served in arrival order: a Wait takes the next free slot
// and sleeps until it; an Allow takes it if it is due and is told when it
// will be otherwise. A request that finds fewer free slots than it needs
// queues behind the lease call (one at a time per subject), which serves
// the queue in order when it returns; a request that cannot be served
// from leases (the subject is not leasing, the call failed or was denied,
// a multi-permit request spans two leases) goes to Redis on its own, as
// without LocalLease.

const (
	// minLocalLease is the smallest lease worth a call: below it, every
	// request goes to Redis on its own, exactly.
	minLocalLease = 4
	// maxLeaseSpan bounds a lease at this many LocalLease of the rule's
	// rate, so that several processes interleave and a dead one loses
	// little.
	maxLeaseSpan = 2
	// leaseHorizonSpans bounds how far ahead, in LocalLease, the last slot
	// of a lease may lie (also bounded by MaxWait): further means the
	// bucket is booked by others, and the caller is better served by the
	// exact path.
	leaseHorizonSpans = 40
	// demandWindow is the window over which a process measures its demand
	// for a subject.
	demandWindow = 100 * time.Millisecond
	// leaseBackoff is how long a subject goes unleased after a lease call
	// failed or was denied.
	leaseBackoff = 100 * time.Millisecond
	// leaseIdleMin is the least time without requests after which the
	// unused slots of a subject are given back.
	leaseIdleMin = time.Millisecond
	// leaseForget is how long a subject without slots or requests is
	// remembered (its demand) before the sweep drops it.
	leaseForget = time.Second
	// leaseCallTimeout bounds a lease or refund call.
	leaseCallTimeout = 2 * time.Second
)

// leaser hands out leased permits of a limiter whose one rule is a bucket.
type leaser struct {
	exact    // what a lease does not serve
	lim      *Limiter
	slack    time.Duration // δ, Options.LocalLease
	count    uint64        // the rule's count and period in ns, reduced:
	periodNs uint64        // one slot every periodNs / count ns, exactly
	rate     float64       // permits per second
	maxLease int
	horizon  time.Duration
	clock    leaseClock
	refill   atomic.Int64 // a lease call's refill latency, ns, a moving average (refillLatency)

	keys     sync.Map // subject → *leasedKey
	sweeping atomic.Bool
	sweeper  atomic.Pointer[time.Timer] // the next sweep, stopped by close
}

// newLeaser returns the leaser for ex's limiter, or nil if opts do not
// lease. It returns a *ConfigError if LocalLease is set on rules that
// cannot lease.
func newLeaser(ex exact, opts Options) (*leaser, error) {
	l := ex.l
	d := opts.LocalLease
	if d == 0 {
		return nil, nil
	}
	bad := func(reason string) error {
		return &ConfigError{Field: "local_lease", Reason: fmt.Sprintf("%v %s", d, reason)}
	}
	if d < 0 {
		return nil, bad("must not be negative")
	}
	if len(l.rules) != 1 || !l.rules[0].Algorithm.bucket() {
		return nil, bad("needs a limiter of exactly one token_bucket or gcra rule: windows cannot lease")
	}
	r := l.rules[0]
	if d > r.Limit.Period/10 {
		return nil, bad(fmt.Sprintf("must be at most a tenth of the rule's period (%v)", r.Limit.Period))
	}
	count, period := lowestTerms(int64(r.Limit.Count), r.Limit.Period.Microseconds())
	q := &leaser{
		exact:    ex,
		lim:      l,
		slack:    d,
		count:    uint64(count),
		periodNs: uint64(period) * 1000,
		rate:     float64(r.Limit.Count) / r.Limit.Period.Seconds(),
		horizon:  leaseHorizonSpans * d,
	}
	q.maxLease = int(q.rate * maxLeaseSpan * d.Seconds())
	if opts.MaxWait > 0 {
		q.horizon = min(q.horizon, opts.MaxWait)
	}
	return q, nil
}

// offset is the time of j slots, floor(j × period / count) ns.
func (q *leaser) offset(j int) time.Duration {
	hi, lo := bits.Mul64(uint64(j), q.periodNs)
	if hi >= q.count {
		return 1<<63 - 1
	}
	v, _ := bits.Div64(hi, lo, q.count)
	return time.Duration(min(v, 1<<63-1))
}

// slotsWithin is the largest j whose offset is at most d (d ≥ 0).
func (q *leaser) slotsWithin(d time.Duration) int {
	// offset(j) ≤ d ⟺ j × period < (d + 1) × count.
	hi, lo := bits.Mul64(uint64(d)+1, q.count)
	if hi >= q.periodNs {
		return 1<<31 - 1
	}
	v, rem := bits.Div64(hi, lo, q.periodNs)
	if rem == 0 {
		v--
	}
	return int(min(v, 1<<31-1))
}

// leasedKey is one subject's leases in this process.
type leasedKey struct {
	mu      sync.Mutex
	leases  []*lease    // in slot order
	spare   []slot      // slots given back by cancelled waits, by hi
	pending []*leaseReq // requests waiting for a lease, in arrival order
	// renewing: a lease call is out; backoff: no lease call before it.
	renewing bool
	backoff  time.Time
	// Demand: permits asked for in the current and previous demandWindow.
	win       time.Time
	cur, prev int64
	last      time.Time // the last request
	back      time.Time // the latest moment a denied Allow was told to come back
	sleeping  int       // waits holding slots, not yet woken
	exactOut  int       // permits asked for by callers on the exact path, not yet answered
	idle      *time.Timer
	gone      bool // swept: callers look the subject up again
}

// lease is one run of slots granted by one call. Slot i (0 ≤ i < k) lies
// on the Redis clock at the ticket less (k - 1 - i) intervals, and never
// before the Redis now of the grant (a full bucket's burst). lo and hi
// bracket its local moment.
type lease struct {
	k        int    // slots granted
	next     int    // the first slot neither handed out nor dropped
	end      int    // slots from end on were given back
	ticket   string // the reservation's refund ticket: its last slot
	booked   int64  // the Redis time (µs) of the grant, for its refund
	at       slot   // the local moment of the grant's Redis now
	last     slot   // the local moment of slot k - 1
	returned bool   // its tail was given back (once only)
}

// slot brackets the local moment of a Redis time: it lies in [lo, hi].
type slot struct{ lo, hi time.Time }

// slotAt returns slot i of ls.
func (q *leaser) slotAt(ls *lease, i int) slot {
	off := q.offset(ls.k - 1 - i)
	s := slot{lo: ls.last.lo.Add(-off - 1), hi: ls.last.hi.Add(-off)}
	if s.lo.Before(ls.at.lo) {
		s.lo = ls.at.lo
	}
	if s.hi.Before(ls.at.hi) {
		s.hi = ls.at.hi
	}
	return s
}

// live reports whether s may still be handed out at t: no later than δ
// after its moment.
func (q *leaser) live(s slot, t time.Time) bool { return !t.After(s.lo.Add(q.slack)) }

// expire drops every slot that can no longer be handed out at t.
func (q *leaser) expire(k *leasedKey, t time.Time) {
	for len(k.spare) > 0 && !q.live(k.spare[0], t) {
		k.spare = k.spare[1:]
	}
	for len(k.leases) > 0 {
		ls := k.leases[0]
		if ls.next < ls.end && !q.live(ls.at, t) {
			// The first slot i still live: slot i's lo + δ ≥ t, that is
			// offset(k - 1 - i) ≤ last.lo + δ - t.
			d := ls.last.lo.Add(q.slack).Sub(t) - 1
			if d < 0 {
				ls.next = ls.end
			} else {
				ls.next = max(ls.next, ls.k-1-q.slotsWithin(d))
			}
		}
		if ls.next < ls.end {
			return
		}
		k.leases = k.leases[1:]
	}
}

// free counts the slots of k not handed out (live or not).
func free(k *leasedKey) int {
	n := len(k.spare)
	for _, ls := range k.leases {
		n += ls.end - ls.next
	}
	return n
}

// pick finds the n earliest free slots of k, the spare ones and the
// leases' merged by time, without taking them: how many come from the
// spare list, and the moment of the last. enough is false if k holds fewer
// than n; ok is false if, besides, the first of them would be handed out
// more than δ late (a request spanning two leases), which the exact path
// then serves. expire(k, t) must come first.
func (q *leaser) pick(k *leasedKey, n int, t time.Time) (spare int, last slot, enough, ok bool) {
	li, next := 0, -1
	var first slot
	for got := range n {
		var s slot
		fromLease := false
		for li < len(k.leases) {
			ls := k.leases[li]
			if next < 0 {
				next = ls.next
			}
			if next < ls.end {
				s, fromLease = q.slotAt(ls, next), true
				break
			}
			li, next = li+1, -1
		}
		if spare < len(k.spare) && (!fromLease || !k.spare[spare].hi.After(s.hi)) {
			s = k.spare[spare]
			spare++
		} else if !fromLease {
			return 0, slot{}, false, false
		} else {
			next++
		}
		if got == 0 {
			first = s
		}
		last = s
	}
	at := last.hi
	if t.After(at) {
		at = t
	}
	return spare, last, true, q.live(first, at)
}

// take hands out what pick found: spare slots from the spare list, the
// rest from the leases in order.
func take(k *leasedKey, n, spare int) {
	k.spare = k.spare[spare:]
	n -= spare
	for n > 0 {
		ls := k.leases[0]
		m := min(n, ls.end-ls.next)
		ls.next += m
		n -= m
		if ls.next >= ls.end {
			k.leases = k.leases[1:]
		}
	}
}

// giveBack returns the slots of a cancelled wait, if still live, to the
// spare list.
func (q *leaser) giveBack(k *leasedKey, ss []slot, t time.Time) {
	for _, s := range ss {
		if q.live(s, t) {
			i, _ := slices.BinarySearchFunc(k.spare, s, func(a, b slot) int { return a.hi.Compare(b.hi) })
			k.spare = slices.Insert(k.spare, i, s)
		}
	}
}

// note counts n permits asked for at t.
func note(k *leasedKey, n int, t time.Time) {
	if d := t.Sub(k.win); d >= demandWindow {
		if d < 2*demandWindow {
			k.prev, k.win = k.cur, k.win.Add(demandWindow)
		} else {
			k.prev, k.win = 0, t
		}
		k.cur = 0
	}
	k.cur += int64(n)
	k.last = t
}

// size is the lease k's demand at t justifies: 0 if below minLocalLease.
//
// For an observed demand of r permits a second and the rule's rate R it
// is the least of three:
//
//   - maxLease (2δ of the rate), which bounds what a dead process loses;
//   - δ·r / (1 − r/R), the most that arrivals at r can take from a run of
//     slots 1/R apart before the last is δ late: a larger lease would
//     drop slots unused;
//   - δ·√(r·R) / 4, or what arrives during two refills (2·r·L, L the
//     refill latency) if more, which keeps the processes that share a key
//     even.
//     Under contention a process's arrivals (its waiters coming back)
//     follow what it got, and it gets in proportion to its lease size, so
//     a size that grew faster than r would let whoever got more lease
//     more; a size that grows as √r gives the smaller share the larger
//     lease for its demand, and the shares converge. Up to about 16
//     processes on a key this term is the smaller of the last two.
//
// The refill term keeps one call at a time ahead of demand on a loaded
// machine, where a refill takes far longer than the network (the call's
// goroutine, and then the callers it serves, wait for a CPU): r is the
// demand served, so a lease of r·L would only repeat it, with callers
// queued behind every call; a lease of 2·r·L lasts until the next one,
// started at the low-water mark, arrives, and lets r grow to the callers'
// demand.
//
// The size is at least what callers on the exact path asked for (up to
// maxLease): they are a queue, not arrivals at r. Without it a process
// whose leases ran dry on a loaded machine stays on the exact path, every
// request a Redis round trip that is slow under load, so that the demand
// served stays below what justifies a lease (δ·r under 4) however many
// callers wait (BENCHMARKS.md, issue 25).
func (q *leaser) size(k *leasedKey, t time.Time) int {
	r := demand(k, t)
	d := q.slack.Seconds()
	n := max(d*math.Sqrt(r*q.rate)/4, 2*r*q.refillLatency().Seconds())
	n = min(n, float64(q.maxLease))
	if r < q.rate {
		n = min(n, d*r/(1-r/q.rate))
	}
	n = max(n, float64(min(k.exactOut, q.maxLease)))
	if n < minLocalLease {
		return 0
	}
	return int(n)
}

// demand is k's observed demand at t, permits per second.
func demand(k *leasedKey, t time.Time) float64 {
	return float64(k.prev+k.cur) / (demandWindow + t.Sub(k.win)).Seconds()
}

// refillLatency is how long recent lease calls took from the moment one
// was decided to the moment its reply served the queue (a moving
// average): the round trip, and on a loaded machine the waits for a CPU
// before the call is sent and after its reply came.
func (q *leaser) refillLatency() time.Duration { return time.Duration(q.refill.Load()) }

// noteRefill adds a lease call decided at from and served at to to the
// refill latency's moving average.
func (q *leaser) noteRefill(from, to time.Time) {
	q.refill.Store((7*q.refill.Load() + int64(to.Sub(from))) / 8)
}

// lock returns subject's state, created if new, locked.
func (q *leaser) lock(subject string) *leasedKey {
	for {
		v, ok := q.keys.Load(subject)
		if !ok {
			v, ok = q.keys.LoadOrStore(subject, &leasedKey{win: time.Now()})
			if !ok && !q.sweeping.Swap(true) {
				q.sweeper.Store(time.AfterFunc(leaseForget, q.sweep))
			}
		}
		k := v.(*leasedKey)
		k.mu.Lock()
		if !k.gone {
			return k
		}
		k.mu.Unlock()
	}
}

// sweep forgets subjects without slots, requests or calls for leaseForget,
// and runs again while any subject is left.
func (q *leaser) sweep() {
	if q.lim.closed.Load() {
		return
	}
	t := time.Now()
	left := false
	q.keys.Range(func(s, v any) bool {
		k := v.(*leasedKey)
		k.mu.Lock()
		if t.Sub(k.last) >= leaseForget && free(k) == 0 && len(k.pending) == 0 && !k.renewing {
			k.gone = true
			q.keys.Delete(s)
		} else {
			left = true
		}
		k.mu.Unlock()
		return true
	})
	if !left {
		q.sweeping.Store(false)
		// A subject added meanwhile may have found the sweep still on.
		q.keys.Range(func(any, any) bool { left = true; return false })
		if !left || q.sweeping.Swap(true) {
			return
		}
	}
	q.sweeper.Store(time.AfterFunc(leaseForget, q.sweep))
}

// drop forgets subject's slots in this process (a pause, a reset): they
// are neither handed out nor given back.
func (q *leaser) drop(subject string) {
	if v, ok := q.keys.Load(subject); ok {
		k := v.(*leasedKey)
		k.mu.Lock()
		k.leases, k.spare = nil, nil
		k.mu.Unlock()
	}
}

// leaseReq is a request waiting for a lease call.
type leaseReq struct {
	n      int
	allow  bool      // Allow (answer now) rather than Wait (take a slot)
	bound  time.Time // Wait: the latest moment it may be admitted; zero: none
	done   chan struct{}
	served bool // took its slots: at is its moment
	at     slot
	spare  []slot // Wait: the slots it took, for giving back
	plain  bool   // go to Redis on its own (no lease could serve it)
	res    Result // Allow: the answer
}

// leasable reports whether n permits can come from a lease at all.
func (q *leaser) leasable(n int) bool {
	return n >= 1 && n <= q.lim.rules[0].Limit.Burst && q.offset(n-1) <= q.slack/2
}

func (q *leaser) allow(ctx context.Context, subject string, n int) (Result, error) {
	if res, ok, err := q.allowLocal(ctx, subject, n); ok {
		return res, err
	}
	defer q.onExact(subject, n)()
	return q.exact.allow(ctx, subject, n)
}

func (q *leaser) wait(ctx context.Context, subject string, n int) (*Place, error) {
	if ok, err := q.waitLocal(ctx, subject, n); ok {
		return nil, err
	}
	defer q.onExact(subject, n)()
	return q.exact.wait(ctx, subject, n)
}

// onExact counts n permits of subject asked for on the exact path until
// done is called, if a lease could serve them: callers waiting on Redis
// are demand that the count of arrivals does not show (size).
func (q *leaser) onExact(subject string, n int) (done func()) {
	if !q.leasable(n) {
		return func() {}
	}
	k := q.lock(subject)
	k.exactOut += n
	k.mu.Unlock()
	return func() {
		k.mu.Lock()
		k.exactOut -= n
		k.mu.Unlock()
	}
}

func (q *leaser) forget(subject string) { q.drop(subject) }

// close stops the sweep and the idle checks, waits for the lease calls
// under way, and gives back the unused tails of every subject's leases.
func (q *leaser) close() {
	if t := q.sweeper.Load(); t != nil {
		t.Stop()
	}
	q.lim.bg.close()
	t := time.Now()
	q.keys.Range(func(subject, v any) bool {
		k := v.(*leasedKey)
		k.mu.Lock()
		if k.idle != nil {
			k.idle.Stop()
			k.idle = nil
		}
		back := q.tails(k, t)
		k.mu.Unlock()
		q.giveBackTails(subject.(string), back)
		return true
	})
}

// allowLocal answers AllowN from subject's leases. handled is false if the
// exact path must answer instead (the caller then asks Redis).
func (q *leaser) allowLocal(ctx context.Context, subject string, n int) (res Result, handled bool, err error) {
	if !q.leasable(n) {
		return Result{}, false, nil
	}
	k := q.lock(subject)
	t := time.Now()
	note(k, n, t)
	q.expire(k, t)
	if len(k.pending) == 0 {
		sp, last, enough, ok := q.pick(k, n, t)
		if ok {
			res = q.answer(k, n, sp, last, t)
			q.renewIfLow(ctx, subject, k, t)
			k.mu.Unlock()
			return res, true, nil
		}
		if enough {
			k.mu.Unlock()
			return Result{}, false, nil
		}
	}
	r := q.enqueue(ctx, subject, k, n, true, time.Time{}, t)
	k.mu.Unlock()
	if r == nil {
		return Result{}, false, nil
	}
	if err := q.await(ctx, k, r); err != nil {
		return Result{}, true, err
	}
	if r.plain {
		return Result{}, false, nil
	}
	return r.res, true, nil
}

// answer decides an Allow of n from slots pick found at t, taking them if
// they are due.
func (q *leaser) answer(k *leasedKey, n, sp int, last slot, t time.Time) Result {
	r := q.lim.rules[0]
	res := Result{Rule: r.Name, Limit: r.Limit}
	if last.hi.After(t) {
		// Callers denied one after the other are told successive slots,
		// so that they come back one by one, in the order they asked, not
		// all at the first.
		at := last.hi
		if next := k.back.Add(q.offset(n)); next.After(at) {
			at = next
		}
		k.back = at
		res.RetryAfter = at.Sub(t)
		res.ResetAfter = res.RetryAfter
	} else {
		take(k, n, sp)
		res.Allowed = true
	}
	res.Remaining = q.due(k, t)
	return res
}

// due counts the free slots that could be handed out at t, for Remaining.
func (q *leaser) due(k *leasedKey, t time.Time) int {
	n := 0
	for _, s := range k.spare {
		if !s.hi.After(t) {
			n++
		}
	}
	for _, ls := range k.leases {
		if ls.at.hi.After(t) {
			break
		}
		// slot i is due if offset(k - 1 - i) ≥ last.hi - t: the slots up
		// to k - 1 - j, j the fewest intervals that long.
		last := ls.end - 1
		if e := ls.last.hi.Sub(t); e > 0 {
			j := q.slotsWithin(e-1) + 1
			last = min(last, ls.k-1-j)
		}
		if last < ls.next {
			break
		}
		n += last - ls.next + 1
	}
	return n
}

// waitLocal serves WaitN from subject's leases: it takes the next n free
// slots in arrival order and sleeps until the last. handled is false if
// the exact path must serve it instead.
func (q *leaser) waitLocal(ctx context.Context, subject string, n int) (handled bool, err error) {
	if !q.leasable(n) {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, err
	}
	t := time.Now()
	var latest time.Time
	bound, byDeadline := q.lim.waitBound(ctx, t)
	if bound >= 0 {
		latest = t.Add(bound)
	}
	k := q.lock(subject)
	note(k, n, t)
	q.expire(k, t)
	var r *leaseReq
	if len(k.pending) == 0 {
		sp, last, enough, ok := q.pick(k, n, t)
		switch {
		case ok && !latest.IsZero() && last.hi.After(latest):
			k.mu.Unlock()
			return true, q.delayError(last.hi.Sub(t), byDeadline)
		case ok:
			r = &leaseReq{n: n, served: true, at: last, spare: q.taken(k, n, sp)}
			take(k, n, sp)
			k.sleeping++
			q.renewIfLow(ctx, subject, k, t)
		case enough:
			k.mu.Unlock()
			return false, nil
		}
	}
	queued := r == nil
	if queued {
		r = q.enqueue(ctx, subject, k, n, false, latest, t)
	}
	k.mu.Unlock()
	if r == nil {
		return false, nil
	}
	if queued {
		if err := q.await(ctx, k, r); err != nil {
			return true, err
		}
		if r.plain {
			return false, nil
		}
		if !r.served { // past its bound
			return true, q.delayError(r.at.hi.Sub(t), byDeadline)
		}
	}
	err = sleep(ctx, time.Until(r.at.hi))
	k.mu.Lock()
	k.sleeping--
	if err != nil {
		q.giveBack(k, r.spare, time.Now())
	}
	k.mu.Unlock()
	return true, err
}

// taken lists the n slots pick found (sp of them spare), for a wait that
// may give them back.
func (q *leaser) taken(k *leasedKey, n, sp int) []slot {
	ss := slices.Clone(k.spare[:sp])
	for _, ls := range k.leases {
		for i := ls.next; i < ls.end && len(ss) < n; i++ {
			ss = append(ss, q.slotAt(ls, i))
		}
	}
	return ss
}

func (q *leaser) delayError(d time.Duration, byDeadline bool) error {
	return &DelayError{Rule: q.lim.rules[0].Name, RetryAfter: d, Deadline: byDeadline}
}

// enqueue queues a request for the lease call under way, or starts one.
// It returns nil if subject is not leasing at t: the caller goes to Redis.
func (q *leaser) enqueue(ctx context.Context, subject string, k *leasedKey, n int, allow bool, bound, t time.Time) *leaseReq {
	if !k.renewing && !q.renew(ctx, subject, k, t) {
		return nil
	}
	r := &leaseReq{n: n, allow: allow, bound: bound, done: make(chan struct{})}
	k.pending = append(k.pending, r)
	return r
}

// await waits for r's answer. If ctx ends first, r leaves the queue, or
// gives its slots back if it was just served.
func (q *leaser) await(ctx context.Context, k *leasedKey, r *leaseReq) error {
	select {
	case <-r.done:
		return nil
	case <-ctx.Done():
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if i := slices.Index(k.pending, r); i >= 0 {
		k.pending = slices.Delete(k.pending, i, i+1)
	} else if r.served && !r.allow {
		q.giveBack(k, r.spare, time.Now())
		k.sleeping--
	}
	return ctx.Err()
}

// renewIfLow starts a lease call if k holds less than one lease.
func (q *leaser) renewIfLow(ctx context.Context, subject string, k *leasedKey, t time.Time) {
	if !k.renewing {
		// One lease, or what two refills of lease calls take at the
		// current demand, if more (at most maxLease, so that a process
		// never holds more than 2 × maxLease): the next lease comes before
		// these run out.
		low := max(float64(q.size(k, t)), min(2*demand(k, t)*q.refillLatency().Seconds(), float64(q.maxLease)))
		if low >= minLocalLease && float64(free(k)) < low {
			q.renew(ctx, subject, k, t)
		}
	}
}

// renew starts a lease call for subject if its demand justifies one and it
// is not backing off. k.mu is held.
func (q *leaser) renew(ctx context.Context, subject string, k *leasedKey, t time.Time) bool {
	n := q.size(k, t)
	if n == 0 || t.Before(k.backoff) {
		return false
	}
	ctx = context.WithoutCancel(ctx)
	from := time.Now()
	k.renewing = q.lim.bg.start(func() { q.call(ctx, subject, k, n, from) }) // not after Close
	return k.renewing
}

// call leases n slots of subject: a reservation of n permits whose last
// slot is at most the horizon away, then serves the queued requests. The
// call was decided at from.
func (q *leaser) call(ctx context.Context, subject string, k *leasedKey, n int, from time.Time) {
	ctx, cancel := ownTimeout(ctx, leaseCallTimeout)
	defer cancel()
	l := q.lim
	var ls *lease
	keys, args, err := l.request(opReserve, subject, 1, q.horizon.Microseconds(), nil)
	if err == nil {
		args[1] = n // a lease may exceed the burst: its slots come one interval apart
		send := time.Now()
		var cmd *redis.Cmd
		// opReserve may fail open: exec leaves reporting a failure to the
		// caller, here the requests that then go to Redis on their own.
		cmd, err = l.exec(ctx, opReserve, l.scripts.allow, keys, args)
		recv := time.Now()
		var raw []any
		if err == nil {
			raw, err = cmd.Slice()
		}
		if err == nil {
			var rep reply
			rep, ls, err = q.grant(raw, n, send, recv)
			if errors.Is(err, errUncertainClock) {
				ticket, booked := rep.tickets(1)[0], rep.redisNow
				q.lim.bg.run(func() { q.giveBackLease(context.WithoutCancel(ctx), subject, n, ticket, booked) })
			}
		}
	}
	k.mu.Lock()
	t := time.Now()
	q.noteRefill(from, t)
	k.renewing = false
	if ls == nil {
		k.backoff = t.Add(leaseBackoff)
	} else {
		k.leases = append(k.leases, ls)
		q.armIdle(subject, k)
	}
	q.expire(k, t)
	q.serve(ctx, subject, k, t, ls != nil)
	k.mu.Unlock()
	_ = err // the requests that go to Redis on their own report Redis's errors
}

// grant reads a lease call's reply: the lease, or nil if denied (the
// bucket is booked past the horizon) or if the local moment of Redis's
// clock is too uncertain to hand slots out within δ.
func (q *leaser) grant(raw []any, n int, send, recv time.Time) (reply, *lease, error) {
	rep, err := q.lim.parse(raw)
	if err != nil || !rep.Allowed {
		return rep, nil, err
	}
	tk := rep.tickets(1)
	if len(tk) != 1 {
		return rep, nil, badReply(raw)
	}
	var w, r int64
	if _, err := fmt.Sscanf(tk[0], "%d %d", &w, &r); err != nil {
		return rep, nil, badReply(raw)
	}
	redisNow := rep.redisNow
	base, ok := q.clock.observe(send, recv, redisNow)
	if !ok || base.hi.Sub(base.lo) > q.slack/2 {
		// Round trips too slow to place slots within δ: give it back.
		return rep, nil, errUncertainClock
	}
	now := time.Duration(redisNow) * time.Microsecond
	ls := &lease{k: n, end: n, ticket: tk[0], booked: redisNow, at: slot{lo: base.lo.Add(now), hi: base.hi.Add(now)}}
	// The last slot: w µs + r / count µs, r < count.
	x := time.Duration(w)*time.Microsecond + time.Duration(uint64(r)*1000/q.count)
	ls.last = slot{lo: base.lo.Add(x), hi: base.hi.Add(x + 1)}
	return rep, ls, nil
}

// serve hands the queued requests their slots, in arrival order, after a
// lease call (leased tells whether it got a lease). A request no slot can
// serve waits for the next lease call if this one leased, or goes to Redis
// on its own.
func (q *leaser) serve(ctx context.Context, subject string, k *leasedKey, t time.Time, leased bool) {
	i := 0
	for ; i < len(k.pending); i++ {
		r := k.pending[i]
		sp, last, enough, ok := q.pick(k, r.n, t)
		if !enough {
			break
		}
		if !ok {
			r.plain = true
			close(r.done)
			continue
		}
		if r.allow {
			r.res = q.answer(k, r.n, sp, last, t)
			r.served = r.res.Allowed
		} else {
			r.at = last
			if r.bound.IsZero() || !last.hi.After(r.bound) {
				r.spare = q.taken(k, r.n, sp)
				take(k, r.n, sp)
				r.served = true
				k.sleeping++
			}
		}
		close(r.done)
	}
	rest := k.pending[i:]
	k.pending = nil
	if len(rest) > 0 && leased && q.renew(ctx, subject, k, t) {
		k.pending = slices.Clone(rest)
		return
	}
	for _, r := range rest {
		r.plain = true
		close(r.done)
	}
	q.renewIfLow(ctx, subject, k, t)
}

// armIdle starts k's idle check unless it runs.
func (q *leaser) armIdle(subject string, k *leasedKey) {
	if k.idle == nil {
		k.idle = time.AfterFunc(q.idleGap(k, time.Now()), func() {
			q.lim.bg.start(func() { q.checkIdle(subject, k) }) // not after Close
		})
	}
}

// idleGap is how long without requests makes k idle: four of its usual
// gaps between requests, at least leaseIdleMin, at most 2δ.
func (q *leaser) idleGap(k *leasedKey, t time.Time) time.Duration {
	asked := k.prev + k.cur
	span := demandWindow + t.Sub(k.win)
	if asked == 0 {
		return max(leaseIdleMin, 2*q.slack)
	}
	return min(max(leaseIdleMin, 4*span/time.Duration(asked)), max(leaseIdleMin, 2*q.slack))
}

// idleSince is when k went idle, or will: idleGap after its last request,
// or after the moment a denied Allow was told to come back.
func (q *leaser) idleSince(k *leasedKey, t time.Time) time.Time {
	from := k.last
	if k.back.After(from) {
		from = k.back
	}
	return from.Add(q.idleGap(k, t))
}

// checkIdle gives back the unused tail of k's leases once k is idle (no
// request, no wait holding a slot), and runs again while k holds slots.
func (q *leaser) checkIdle(subject string, k *leasedKey) {
	t := time.Now()
	var back []tail
	k.mu.Lock()
	q.expire(k, t)
	if !t.Before(q.idleSince(k, t)) && len(k.pending) == 0 && k.sleeping == 0 {
		back = q.tails(k, t)
	}
	if free(k) > 0 {
		k.idle.Reset(max(q.idleSince(k, t).Sub(t), leaseIdleMin/4))
	} else {
		k.idle = nil
	}
	k.mu.Unlock()
	q.giveBackTails(subject, back)
}

// tail is the unused end of a lease, to give back.
type tail struct {
	n      int
	ticket string
	booked int64
}

// tails takes the unused tails of k's leases that Redis can take back at
// t. k.mu is held.
func (q *leaser) tails(k *leasedKey, t time.Time) []tail {
	var back []tail
	// The latest lease first: the bucket takes back only a tail that no
	// later reservation follows (else it records it, bucket.lua), and each
	// refund moves that tail to the lease before. Slots already past are
	// given back too: the bucket counts them as unused, as if never taken,
	// which they were not (below a full bucket, bk_refund clamps).
	for i := len(k.leases) - 1; i >= 0; i-- {
		ls := k.leases[i]
		if ls.returned || ls.end != ls.k || ls.next == ls.end || !ls.last.lo.After(t) {
			break
		}
		back = append(back, tail{ls.end - ls.next, ls.ticket, ls.booked})
		ls.end, ls.returned = ls.next, true
		if ls.next > 0 {
			break // its head was handed out: earlier leases are no tail
		}
	}
	q.expire(k, t)
	return back
}

// giveBackTails gives back tails of subject's leases, in order, until
// Redis fails.
func (q *leaser) giveBackTails(subject string, back []tail) {
	for _, b := range back {
		if !q.giveBackLease(context.Background(), subject, b.n, b.ticket, b.booked) {
			return
		}
	}
}

// errUncertainClock: a lease's round trips were too slow to place its
// slots on the local clock within δ.
var errUncertainClock = errors.New("throttle: lease round trips too slow to place slots")

// giveBackLease refunds the last n slots of the lease whose ticket is
// ticket, granted at the Redis time booked (bucket.lua's refund, which
// takes back only what no later reservation follows; nothing if the rule
// was reset since), and reports whether Redis answered.
func (q *leaser) giveBackLease(ctx context.Context, subject string, n int, ticket string, booked int64) bool {
	ctx, cancel := ownTimeout(ctx, leaseCallTimeout)
	defer cancel()
	l := q.lim
	keys, args, err := l.request(opRefund, subject, 1, booked, []string{ticket})
	if err != nil {
		return false
	}
	args[1] = n // the tail of a lease, which may exceed the burst
	keys = append(keys, l.givebackKeys(subject, cancelledSuffix)...)
	_, err = l.exec(ctx, opRefund, l.scripts.refund, keys, args) // which reports a failure
	return err == nil
}

// leaseClock brackets the local moment of Redis's clock zero from the
// lease calls' round trips: Redis read its TIME after a call was sent and
// before its reply came, so for every recent call
//
//	send - redisNow - 1µs ≤ base ≤ recv - redisNow,
//
// and the tightest bracket is the latest send and the earliest receipt.
// It keeps them over two buckets of clockSpan, so that it follows a
// drifting clock.
type leaseClock struct {
	mu     sync.Mutex
	origin time.Time
	b      [2]clockBracket
}

type clockBracket struct {
	k      int64
	lo, hi time.Time
	set    bool
}

const clockSpan = 500 * time.Millisecond

// observe adds a call and returns the bracket over the recent ones; ok is
// false if they disagree (a clock stepped).
func (c *leaseClock) observe(send, recv time.Time, redisNow int64) (slot, bool) {
	// Redis TIME is whole µs: its true moment lies in [now, now + 1µs).
	now := time.Duration(redisNow) * time.Microsecond
	lo, hi := send.Add(-now-time.Microsecond), recv.Add(-now)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.origin.IsZero() {
		c.origin = recv
	}
	k := int64(recv.Sub(c.origin) / clockSpan)
	b := &c.b[k%2]
	if !b.set || b.k != k {
		*b = clockBracket{k: k, lo: lo, hi: hi, set: true}
	} else {
		if lo.After(b.lo) {
			b.lo = lo
		}
		if hi.Before(b.hi) {
			b.hi = hi
		}
	}
	s := slot{lo: b.lo, hi: b.hi}
	if o := c.b[(k+1)%2]; o.set && o.k == k-1 {
		if o.lo.After(s.lo) {
			s.lo = o.lo
		}
		if o.hi.Before(s.hi) {
			s.hi = o.hi
		}
	}
	if s.hi.Before(s.lo) {
		return slot{lo: b.lo, hi: b.hi}, !b.hi.Before(b.lo)
	}
	return s, true
}
