package throttle

import (
	"sync"
	"time"
)

// redisClock maps Redis TIME onto this process's monotonic clock, for one
// purpose only: to know when to wake for a slot that Redis chose. Every
// decision stays in Redis, on its clock; this only decides when a
// sleeping caller looks at its watch.
//
// Waking at "reply read + delay" makes each permit inherit its own reply's
// return latency (Redis, socket, netpoller, scheduler), so on a busy
// machine a reply held up for a slot wakes its permit together with the
// next one. Instead, every reply carries Redis's now (µs), and
//
//	base = min over recent replies of (local receive time − Redis now)
//
// is the local time of Redis's clock zero as seen through the fastest
// recent reply: its error is that reply's return latency, never negative.
// A permit wakes at base + now + delay. On one Redis node this is never
// before the local moment of Redis's slot (base is at least the true
// offset), and it removes the latency a reply had beyond the fastest one.
//
// The minimum is taken over a sliding window of about clockWindow (a few
// buckets of clockBucket each), so the estimate follows a drifting or
// slewed clock and another node after a failover within seconds.
//
// The correction is clamped: a permit never wakes more than
// maxClockCorrection before recv + delay, the wake without the estimate.
// go-redis does not say which node of a Redis Cluster answered, and nodes'
// clocks differ, so a base learnt from one node is applied to replies of
// another; the clamp bounds what that skew (or slew inside the window, or
// a failover to a node whose clock is behind) can do, and so bounds how
// far permits of one key can bunch, at maxClockCorrection.
type redisClock struct {
	mu      sync.Mutex
	origin  time.Time // the first sample's receive time; buckets count from it
	buckets [clockWindow / clockBucket]clockSample
}

// clockSample is the smallest base seen in bucket k, the k-th clockBucket
// after origin.
type clockSample struct {
	k    int64
	base time.Time
	set  bool
}

const (
	// clockBucket and clockWindow: the minimum is over the replies of the
	// last clockWindow - clockBucket to clockWindow. A few seconds hold
	// hundreds of replies at the rates where jitter matters, and NTP slews
	// a clock by at most 0.5 ms per second.
	clockBucket = time.Second
	clockWindow = 4 * time.Second

	// maxClockCorrection bounds how much earlier than recv + delay a
	// permit may wake. It is above the reply delays the estimate exists
	// to remove (a busy client's return latency varies by 1–3 ms, see
	// BENCHMARKS.md's jitter lab) and above the skew of NTP-synchronised
	// servers on one network (well under 1 ms), and below the slot of
	// any rate up to 300 per second, so even wrong information (a cluster
	// node's clock read through another's base, a failover) cannot make
	// two consecutive permits of such a rate wake together.
	maxClockCorrection = 3 * time.Millisecond
)

// wake records a reply received at recv (local, monotonic) that carried
// Redis's now (µs of Redis TIME), and returns the local time at which a
// slot delay after Redis's now falls.
func (c *redisClock) wake(recv time.Time, redisNow int64, delay time.Duration) time.Time {
	at, _ := c.slot(recv, redisNow, delay)
	return at
}

// slot is wake, and also the local time of the slot through the fastest
// recent reply without the clamp (est): how late a caller is for its slot
// when its reply, or the caller itself, was held up longer than the clamp
// allows for, which the wake time alone would hide.
func (c *redisClock) slot(recv time.Time, redisNow int64, delay time.Duration) (at, est time.Time) {
	plain := recv.Add(delay)
	base := c.observe(recv, recv.Add(-time.Duration(redisNow)*time.Microsecond))
	est = base.Add(time.Duration(redisNow)*time.Microsecond + delay)
	if est.Before(plain.Add(-maxClockCorrection)) {
		return plain.Add(-maxClockCorrection), est
	}
	if est.After(plain) {
		// Not possible while this reply is in the window; kept so that
		// the estimate can only ever make a wake earlier.
		return plain, est
	}
	return est, est
}

// observe adds a sample (received at recv, base b) and returns the
// minimum base over the window.
func (c *redisClock) observe(recv, b time.Time) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.origin.IsZero() {
		c.origin = recv
	}
	k := max(0, int64(recv.Sub(c.origin)/clockBucket))
	n := int64(len(c.buckets))
	s := &c.buckets[k%n]
	switch {
	case !s.set || s.k < k:
		*s = clockSample{k: k, base: b, set: true}
	case s.k == k && b.Before(s.base):
		s.base = b
	}
	least := b
	for _, s := range c.buckets {
		if s.set && s.k <= k && k-s.k < n && s.base.Before(least) {
			least = s.base
		}
	}
	return least
}
