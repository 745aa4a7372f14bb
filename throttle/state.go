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
// granted, leave the rest for later. n must be at least 1; n above a
// rule's capacity is capped by what the rule can ever hold. Errors are as
// for AllowN (a fail-open limiter admits all n when Redis fails); a limiter
// with a Concurrency rule is refused first, with a *ConfigError naming it
// (field "algorithm"), whatever n.
func (l *Limiter) AllowAtMost(ctx context.Context, subject string, n int) (granted int, res Result, err error) {
	if l.leases != nil {
		return 0, Result{}, l.leases.only("AllowAtMost")
	}
	if l.parts != nil {
		return 0, Result{}, errOneSubject
	}
	if n < 1 {
		return 0, Result{}, fmt.Errorf("throttle: AllowAtMost(n = %d): n must be at least 1; use AllowN(ctx, subject, 0) to read the state", n)
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
// capacity. Reservations already granted keep their slots but can no
// longer be refunded; prepaid receipts (PrepayN) stay redeemable. It is
// one DEL of the subject's keys. Errors: ErrInvalidSubject, or an error
// matching ErrRedis (FailOpen does not apply).
func (l *Limiter) Reset(ctx context.Context, subject string) error {
	if l.parts != nil {
		var errs []error
		for _, p := range l.parts {
			errs = append(errs, p.lim.Reset(ctx, p.of(subject)))
		}
		return errors.Join(errs...)
	}
	enc, err := encodeSubject(subject)
	if err != nil {
		return err
	}
	keys := make([]string, 0, 2*len(l.rules)+1)
	for _, r := range l.keyRules {
		keys = append(keys, key(l.prefix, enc, r), key(l.prefix, enc, r+cancelledSuffix))
	}
	keys = append(keys, l.pauseKey(subject))
	if l.local != nil {
		l.local.drop(subject)
	}
	return l.result(ctx, opReset, l.rdb.Del(ctx, keys...).Err())
}
