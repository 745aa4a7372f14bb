package throttle

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
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

// maxPause is the longest pause PauseFor accepts.
const maxPause = maxPeriod

// pauseKey returns <prefix>{<subject>}:!pause, which holds the Redis time
// (microseconds) at which the subject's current pause ends, with a TTL of
// the pause. The subject must have passed encodeSubject.
func (p *policy) pauseKey(subject string) string {
	return key(p.prefix, escape(subject), pauseSuffix)
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
// pause keep their slots (httpthrottle checks the pause again before
// acting on those), and refunding them does not release anything before
// the pause ends.
//
// It returns how long the subject stays paused on the Redis clock: d, or
// the rest of a longer pause already running, which a pause never
// shortens. d ≤ 0 pauses nothing and only reads that (0 if no pause
// runs). d above ten years is an error, as are an invalid subject
// (ErrInvalidSubject) and Redis failures (ErrRedis; FailOpen does not
// apply). Each call is one script call.
func (l *Limiter) PauseFor(ctx context.Context, subject string, d time.Duration) (time.Duration, error) {
	if err := l.open(); err != nil {
		return 0, err
	}
	if d > maxPause {
		return 0, fmt.Errorf("throttle: pause of %v: must be at most %v", d, maxPause)
	}
	// Every part's subject: the caller's and the fixed ones.
	var longest time.Duration
	for _, p := range l.mode.parts() {
		left, err := p.lim.pause(ctx, p.of(subject), d)
		if err != nil {
			return longest, err
		}
		longest = max(longest, left)
	}
	return longest, nil
}

// pause is PauseFor's one script call on a limiter over one subject.
func (l *Limiter) pause(ctx context.Context, subject string, d time.Duration) (time.Duration, error) {
	var cmd *redis.Cmd
	var err error
	if d <= 0 {
		if _, err := encodeSubject(subject); err != nil {
			return 0, err
		}
		cmd, err = l.exec(ctx, opPaused, pausedScript, []string{l.pauseKey(subject)}, nil)
	} else {
		us := (d + time.Microsecond - 1) / time.Microsecond
		keys, args, rerr := pauseArgs{subject: subject, us: int64(us)}.build(&l.policy)
		if rerr != nil {
			return 0, rerr
		}
		cmd, err = l.exec(ctx, opPause, l.scripts.pause, keys, args)
	}
	if err != nil {
		return 0, err
	}
	if d > 0 {
		l.mode.forget(subject) // turns leased here before the pause
	}
	us, err := cmd.Int64()
	if err != nil {
		return 0, err
	}
	return time.Duration(us) * time.Microsecond, nil
}

// pausedScript is prelude.lua + paused.lua; see paused.lua for KEYS and
// the reply.
var pausedScript = buildScript("prelude.lua", "paused.lua")
