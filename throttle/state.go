package throttle

import (
	"context"
	"errors"
	"fmt"
)

// A state read: AllowN(ctx, subject, 0) charges nothing and reports the
// subject's state under every rule (see AllowN). AllowAtMost takes what
// there is; Reset forgets the subject.

// AllowAtMost takes as many permits for subject as every rule has now, up
// to n, and reports how many it took: at least 1, or 0 with the Result
// of a denied request of 1 (RetryAfter is when 1 permit frees). It never
// waits. Use it to drain a batch at the pace allowed: take what is
// granted, leave the rest for later. n above a rule's capacity is capped
// by what the rule can ever hold. n = 0 reads the state, as redis_rate's
// AllowAtMost(0) does: it grants 0 and returns AllowN(ctx, subject, 0)'s
// Result, charging nothing. Errors are as for AllowN (a fail-open limiter
// admits all n when Redis fails; a negative n is an error); a limiter
// with a Concurrency rule is refused first, with a *ConfigError naming it
// (field "algorithm"), whatever n.
func (l *Limiter) AllowAtMost(ctx context.Context, subject string, n int) (granted int, res Result, err error) {
	if err := l.open(); err != nil {
		return 0, Result{}, err
	}
	if s, ok := l.mode.(*leases); ok {
		return 0, Result{}, s.only("AllowAtMost")
	}
	if !l.oneSubject() {
		return 0, Result{}, errOneSubject
	}
	if n == 0 {
		res, err := l.AllowN(ctx, subject, 0)
		return 0, res, err
	}
	if n < 0 {
		return 0, Result{}, fmt.Errorf("throttle: AllowAtMost(n = %d): n must not be negative (0 reads the state)", n)
	}
	for _, r := range l.rules {
		n = min(n, r.Limit.capacity(r.Algorithm))
	}
	keys, args, err := l.request(opAtMost, subject, n, unbounded, nil)
	if err != nil {
		return 0, Result{}, err
	}
	rep, _, err := l.call(ctx, opAtMost, keys, args)
	if re, ok := err.(*redisError); ok {
		// atmost is allow of what there is: it fails open as allow does.
		if l.redisFailed(ctx, re.err) {
			return n, Result{Allowed: true, Rule: l.rules[0].Name, Limit: l.rules[0].Limit}, nil
		}
		return 0, Result{}, err
	}
	if err != nil {
		return 0, Result{}, err
	}
	if raw := rep.raw; len(raw) == 6+len(l.rules)+1 { // admitted: the number follows the tickets
		g, ok := raw[len(raw)-1].(int64)
		if !ok || g < 1 || g > int64(n) {
			return 0, Result{}, badReply(raw)
		}
		granted = int(g)
	}
	res = rep.Result
	if res.Allowed != (granted > 0) {
		return 0, Result{}, badReply(rep.raw)
	}
	if res.Allowed {
		res.RetryAfter = 0
	}
	return granted, res, nil
}

// Reset forgets subject's state under every rule of the limiter, and any
// pause (PauseFor) over it: the next request finds every rule at full
// capacity. Reservations already granted keep their slots but give
// nothing back into the new state: not by Cancel, nor by a Wait whose
// context ends, a Settle for less, a part rolled back or a local run's slots
// given back (a Settle for more still charges the new state: see
// Settle). A reservation made in the same microsecond of Redis time as
// the Reset counts as made before it. Prepaid receipts (PrepayN) stay
// redeemable. It is one script call: it deletes the subject's keys and
// records, per rule, the Redis time of the Reset, kept as long as a
// reservation made before it could give something back (lua/reset.lua).
// Errors: ErrInvalidSubject, or an error matching ErrRedis (FailOpen does
// not apply).
func (l *Limiter) Reset(ctx context.Context, subject string) error {
	if err := l.open(); err != nil {
		return err
	}
	var errs []error
	for _, p := range l.mode.parts() {
		errs = append(errs, p.lim.reset(ctx, p.of(subject)))
	}
	return errors.Join(errs...)
}

// reset is Reset's one script call on a limiter over one subject.
func (l *Limiter) reset(ctx context.Context, subject string) error {
	enc, err := encodeSubject(subject)
	if err != nil {
		return err
	}
	keys := make([]string, 0, 4*len(l.rules)+1)
	keys = append(keys, l.pauseKey(subject))
	args := make([]any, len(l.rules))
	for i, r := range l.keyRules {
		keys = append(keys, key(l.prefix, enc, r), key(l.prefix, enc, r+cancelledSuffix),
			key(l.prefix, enc, r+settledSuffix), key(l.prefix, enc, r+resetSuffix))
		args[i] = afterlife(l.rules[i])
	}
	l.mode.forget(subject)
	_, err = l.exec(ctx, opReset, resetScript, keys, args)
	return err
}

// resetSuffix follows a rule's name: <rule>!reset holds the Redis time
// (µs) of the rule's latest Reset, which refunds and settles of
// reservations made before it read (lua/reset.lua, lua/refund.lua, lua/settle.lua).
const resetSuffix = "!reset"

// resetScript is prelude.lua + reset.lua; see reset.lua for KEYS and
// ARGV.
var resetScript = buildScript("prelude.lua", "reset.lua")

// afterlife is how long, in µs, after a rule's key would have expired a
// reservation made on it could still give something back
// (lua/reset.lua): a bucket's settle gives back until two bursts after
// its state's times (bucket.lua); the windows forget everything with
// their key; -1 for a Concurrency rule, which has no refunds.
func afterlife(r Rule) int64 {
	switch {
	case r.Algorithm.spec().holders:
		return -1
	case r.Algorithm.bucket():
		return int64(2 * float64(r.Limit.Burst) * float64(r.Limit.Period.Microseconds()) / float64(r.Limit.Count))
	}
	return 0
}
