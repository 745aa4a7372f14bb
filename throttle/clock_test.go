package throttle

import (
	"testing"
	"time"
)

// The estimator alone, fed synthetic replies: local receive times on a
// made-up monotonic clock and Redis times in µs.
func TestRedisClock(t *testing.T) {
	t0 := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	const redis0 = int64(946_684_800_000_000) // Redis µs at t0, if it had no latency
	// reply is a reply that left Redis at local offset off with the given
	// return latency, for a slot delay after Redis's now.
	type reply struct {
		off, latency, delay time.Duration
		redisSkew           time.Duration // Redis clock ahead (+) or behind (-) of the true one
	}
	us := func(d time.Duration) int64 { return int64(d / time.Microsecond) }
	tests := []struct {
		name    string
		replies []reply
		want    time.Duration // the last reply's wake, as an offset from t0
	}{
		{"first reply wakes at recv + delay",
			[]reply{{off: 0, latency: 700 * time.Microsecond, delay: 5 * time.Millisecond}},
			5700 * time.Microsecond},
		{"a slow reply wakes as the fastest would have",
			[]reply{
				{off: 0, latency: 200 * time.Microsecond},
				{off: 10 * time.Millisecond, latency: 2 * time.Millisecond, delay: 5 * time.Millisecond},
			},
			15200 * time.Microsecond},
		{"a faster reply lowers the base",
			[]reply{
				{off: 0, latency: 900 * time.Microsecond},
				{off: 10 * time.Millisecond, latency: 100 * time.Microsecond, delay: 5 * time.Millisecond},
			},
			15100 * time.Microsecond},
		{"the correction is clamped",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 10 * time.Millisecond, latency: 20 * time.Millisecond, delay: 5 * time.Millisecond},
			},
			35*time.Millisecond - maxClockCorrection},
		{"old samples leave the window",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 5 * time.Second, latency: 1 * time.Millisecond, delay: 5 * time.Millisecond},
			},
			5*time.Second + 6*time.Millisecond},
		{"samples within the window stay",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 2500 * time.Millisecond, latency: 1 * time.Millisecond, delay: 5 * time.Millisecond},
			},
			2500*time.Millisecond + 5100*time.Microsecond},
		{"a node whose clock is behind moves a wake at most the clamp earlier",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 10 * time.Millisecond, latency: 100 * time.Microsecond, delay: 5 * time.Millisecond, redisSkew: -time.Second},
			},
			15100*time.Microsecond - maxClockCorrection},
		{"a base learnt from a node whose clock is ahead moves another's wake at most the clamp earlier",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond, redisSkew: time.Second},
				{off: 10 * time.Millisecond, latency: 100 * time.Microsecond, delay: 5 * time.Millisecond},
			},
			15100*time.Microsecond - maxClockCorrection},
		{"a node whose clock is ahead never delays a wake",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 10 * time.Millisecond, latency: 100 * time.Microsecond, delay: 5 * time.Millisecond, redisSkew: time.Second},
			},
			15100 * time.Microsecond},
		{"after a failover to a node behind, the new clock is learnt within the window",
			[]reply{
				{off: 0, latency: 100 * time.Microsecond},
				{off: 2 * time.Second, latency: 100 * time.Microsecond, redisSkew: -50 * time.Millisecond},
				{off: 5 * time.Second, latency: 1100 * time.Microsecond, delay: 5 * time.Millisecond, redisSkew: -50 * time.Millisecond},
			},
			5*time.Second + 5100*time.Microsecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c redisClock
			var got time.Time
			for _, r := range tt.replies {
				recv := t0.Add(r.off + r.latency)
				got = c.wake(recv, redis0+us(r.off+r.redisSkew), r.delay)
			}
			if d := got.Sub(t0); d != tt.want {
				t.Errorf("wake at t0%+v, want t0%+v", d, tt.want)
			}
		})
	}
}

// On one node, however the latencies vary, no permit wakes before the
// local moment of its slot, nor after recv + delay.
func TestRedisClockNeverEarly(t *testing.T) {
	t0 := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	var c redisClock
	lat := []time.Duration{300, 2500, 80, 4000, 900, 150, 7000, 60, 1200}
	for i := range 2000 {
		off := time.Duration(i) * 3 * time.Millisecond
		l := lat[i%len(lat)] * time.Microsecond
		delay := time.Duration(i%7) * time.Millisecond
		recv := t0.Add(off + l)
		got := c.wake(recv, int64(off/time.Microsecond), delay)
		if slot := t0.Add(off + delay); got.Before(slot) {
			t.Fatalf("reply %d: wakes %v before its slot", i, slot.Sub(got))
		}
		if plain := recv.Add(delay); got.After(plain) {
			t.Fatalf("reply %d: wakes %v after recv + delay", i, got.Sub(plain))
		}
	}
}
