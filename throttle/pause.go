package throttle

import (
	"context"
	"fmt"
	"time"
)

// Keys of a subject that are not a rule's. Rule names are escaped (keys.go),
// and '!' is outside the safe set, so no rule's key can be one of these.
const (
	pauseSuffix    = "!pause"
	receiptsSuffix = "!receipts"
	// cancelledSuffix follows a rule's name: <rule>!cancelled records the
	// rule's cancelled reservations that could not be given back yet.
	cancelledSuffix = "!cancelled"
)

// MaxPause is the longest pause PauseFor accepts.
const MaxPause = MaxPeriod

// pauseKey returns <prefix>{<subject>}:!pause, which holds the Redis time
// (microseconds) at which the subject's current pause ends, with a TTL of
// the pause. The subject must have passed EncodeSubject.
func (l *Limiter) pauseKey(subject string) string {
	return key(l.prefix, escape(subject), pauseSuffix)
}

// PauseFor holds back every rule of the limiter for subject so that no
// permit is granted before d has passed on the Redis clock, whichever
// process asks: use it when the resource behind the limit says to come
// back later (an HTTP 429 or 503 with Retry-After; Transport does this).
//
// After the pause, permits come at the rules' steady rate, not in a
// burst: a token bucket is left in debt so that it holds one token when
// the pause ends, a leaky bucket's next slot is the pause's end, and a
// window rule counts as full until then (sliding_window to its precision).
// Reservations made during the pause are booked after it, in order; one
// Redis round trip per Wait, as always. Reservations granted before the
// pause keep their slots (Transport checks Paused before acting on those),
// and refunding them does not release anything before the pause ends.
//
// A pause never shortens a longer one already running. d ≤ 0 does nothing;
// d above MaxPause is an error, as are an invalid subject (ErrInvalidSubject)
// and Redis failures (ErrRedis; FailOpen does not apply).
func (l *Limiter) PauseFor(ctx context.Context, subject string, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	if d > MaxPause {
		return fmt.Errorf("throttle: pause of %v: must be at most %v", d, MaxPause)
	}
	us := (d + time.Microsecond - 1) / time.Microsecond
	keys, args, err := l.request("pause", subject, 1, int64(us), nil)
	if err != nil {
		return err
	}
	keys = append(keys, l.pauseKey(subject))
	if err := l.run(ctx, l.script, keys, args...).Err(); err != nil {
		if l.opts.OnRedisError != nil {
			l.opts.OnRedisError(err, false)
		}
		return &redisError{op: "pause", err: err}
	}
	if l.leases != nil {
		l.leases.drop(subject) // slots leased here before the pause
	}
	return nil
}

// pausedScript is prelude.lua + paused.lua; see paused.lua for KEYS and
// the reply.
var pausedScript = buildScript("prelude.lua", "paused.lua")

// Paused returns how long the pause of subject set by PauseFor still runs
// on the Redis clock, or 0 if none does. It is one script call.
func (l *Limiter) Paused(ctx context.Context, subject string) (time.Duration, error) {
	if _, err := EncodeSubject(subject); err != nil {
		return 0, err
	}
	us, err := l.run(ctx, pausedScript, []string{l.pauseKey(subject)}).Int64()
	if err != nil {
		if l.opts.OnRedisError != nil {
			l.opts.OnRedisError(err, false)
		}
		return 0, &redisError{op: "paused", err: err}
	}
	return time.Duration(us) * time.Microsecond, nil
}
