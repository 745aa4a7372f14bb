package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Waiter is what every implementation offers the benchmark: block until one
// permit for key is granted.
type Waiter interface {
	Wait(ctx context.Context, key string) error
}

// Allower takes one permit now if there is one (the throughput scenario).
type Allower interface {
	Allow(ctx context.Context, key string) (bool, error)
}

// impl describes one implementation under test.
type impl struct {
	Name      string // as in results: jobthrottle/gcra, redis_rate, x/time/rate …
	Algorithm string // what it implements
	Redis     bool   // backed by Redis (false: one process, no Redis)
	Window    bool   // a window algorithm: burst does not apply
	// Driver: decisions are the library's driver script, whose replies
	// carry Redis's clock (redisclock.go); the library itself, not a
	// prototype or peer.
	Driver bool
	// New builds the limiter for one process. rdb is nil when !Redis.
	New func(rdb redis.UniversalClient, r, burst int) (Waiter, error)
}

var impls = []impl{
	jtImpl(throttle.TokenBucket),
	jtImpl(throttle.GCRA),
	jtImpl(throttle.FixedWindow),
	jtImpl(throttle.SlidingLog),
	jtImpl(throttle.SlidingWindow),
	{Name: "redis_rate", Algorithm: "gcra", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
		return newRedisRate(rdb, r, burst), nil
	}},
	{Name: "mennanov/token_bucket", Algorithm: "token bucket", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
		return newMennanovTokenBucket(rdb, r, burst), nil
	}},
	{Name: "mennanov/leaky_bucket", Algorithm: "leaky bucket (queue)", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
		return newMennanovLeakyBucket(rdb, r, burst), nil
	}},
	{Name: "x/time/rate", Algorithm: "token bucket, in process", New: func(_ redis.UniversalClient, r, burst int) (Waiter, error) {
		return xrate{rate.NewLimiter(rate.Limit(r), burst)}, nil
	}},
}

// unbatchedImpls are the bucket limiters with Options.NoBatching: every
// AllowN is its own EVALSHA, as a lone caller's is. Only the throughput
// part runs them (batching does not touch Wait).
var unbatchedImpls = []impl{jtUnbatched(throttle.GCRA), jtUnbatched(throttle.TokenBucket)}

// refImpls are references, not limiters: only the Allow throughput and the
// server cost run them (floor.go).
var refImpls = []impl{{Name: floorName, Algorithm: "gcra", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
	return newFloor(rdb, r, burst), nil
}}}

func jtUnbatched(a throttle.Algorithm) impl {
	return impl{
		Name:      "jobthrottle/" + string(a) + " (unbatched)",
		Algorithm: string(a),
		Redis:     true,
		Driver:    true,
		New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
			l, err := throttle.New(rdb, throttle.Options{Prefix: "jt:" + string(a) + ":", NoBatching: true},
				throttle.Rule{Name: "r", Algorithm: a, Limit: throttle.PerSecond(r).WithBurst(burst)})
			return jobthrottle{l}, err
		},
	}
}

// labImpls are variants that only the jitter lab (-jitterlab) runs: a
// prototype of a change to throttle/, measured beside the library as it is.
var labImpls = []impl{
	{Name: "jobthrottle/gcra, send-anchored (prototype)", Algorithm: "gcra", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
		j, err := newJobthrottle(rdb, throttle.GCRA, r, burst)
		return sendAnchored{j.Limiter}, err
	}},
	{Name: "gcra, Redis-clock-anchored (prototype)", Algorithm: "gcra", Redis: true, New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
		return newServerAnchored(rdb, r, burst), nil
	}},
}

var errNoAllow = errors.New("bench: this prototype has no Allow")

func implByName(name string) (impl, error) {
	for _, im := range slices.Concat(impls, labImpls, unbatchedImpls, refImpls) {
		if im.Name == name {
			return im, nil
		}
	}
	return impl{}, fmt.Errorf("bench: unknown implementation %q", name)
}

func jtImpl(a throttle.Algorithm) impl {
	return impl{
		Name:      "jobthrottle/" + string(a),
		Algorithm: string(a),
		Redis:     true,
		Window:    a != throttle.TokenBucket && a != throttle.GCRA,
		Driver:    true,
		New: func(rdb redis.UniversalClient, r, burst int) (Waiter, error) {
			return newJobthrottle(rdb, a, r, burst)
		},
	}
}

// jobthrottle wraps throttle.Limiter; its Wait is the library's own.
type jobthrottle struct{ *throttle.Limiter }

var _ Waiter = jobthrottle{}
var _ Allower = jobthrottle{}

func newJobthrottle(rdb redis.UniversalClient, a throttle.Algorithm, r, burst int) (jobthrottle, error) {
	l, err := throttle.New(rdb, throttle.Options{Prefix: "jt:" + string(a) + ":"},
		throttle.Rule{Name: "r", Algorithm: a, Limit: throttle.PerSecond(r).WithBurst(burst)})
	return jobthrottle{l}, err
}

func (j jobthrottle) Allow(ctx context.Context, key string) (bool, error) {
	res, err := j.Limiter.Allow(ctx, key)
	return res.Allowed, err
}

// sendAnchored is Limiter.Wait for a bucket limiter with one change: the
// wake is anchored on when the reservation was sent plus the delay Redis
// returned, instead of on when its reply was read (throttle/limiter.go's
// ask). It wakes early by the request's one-way latency instead of late by
// the reply's, and no longer inherits the reply's queueing.
type sendAnchored struct{ *throttle.Limiter }

func (s sendAnchored) Wait(ctx context.Context, key string) error {
	t0 := time.Now()
	r, err := s.ReserveN(ctx, key, 1)
	if err != nil {
		return err
	}
	d := time.Until(t0.Add(r.Delay()))
	if d <= 0 {
		return nil
	}
	if err := sleepCtx(ctx, d); err != nil {
		_ = r.Cancel(context.WithoutCancel(ctx))
		return err
	}
	return nil
}

// redisRate is go-redis/redis_rate with the wait loop its users write:
// Allow; if denied, sleep RetryAfter; repeat.
type redisRate struct {
	l     *redis_rate.Limiter
	limit redis_rate.Limit
}

var _ Waiter = redisRate{}
var _ Allower = redisRate{}

func newRedisRate(rdb redis.UniversalClient, r, burst int) redisRate {
	return redisRate{redis_rate.NewLimiter(rdb), redis_rate.Limit{Rate: r, Burst: burst, Period: time.Second}}
}

func (r redisRate) Wait(ctx context.Context, key string) error {
	for {
		res, err := r.l.Allow(ctx, key, r.limit)
		if err != nil {
			return err
		}
		if res.Allowed > 0 {
			return nil
		}
		if err := sleepCtx(ctx, res.RetryAfter); err != nil {
			return err
		}
	}
}

// sleepCtx sleeps d, or until ctx ends (its error).
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r redisRate) Allow(ctx context.Context, key string) (bool, error) {
	res, err := r.l.Allow(ctx, key, r.limit)
	if err != nil {
		return false, err
	}
	return res.Allowed > 0, nil
}

// xrate is golang.org/x/time/rate: one process, no Redis, the ideal.
type xrate struct{ l *rate.Limiter }

var _ Waiter = xrate{}

func (x xrate) Wait(ctx context.Context, _ string) error { return x.l.Wait(ctx) }

// roundTrips counts the client's Redis round trips: one per command sent
// alone, one per pipeline. (A Script.Run that meets NOSCRIPT counts two:
// EVALSHA, then EVAL.) The commands go-redis sends once per new connection
// (HELLO, CLIENT SETINFO, AUTH, SELECT) are not counted: a long-lived
// client pays them once, not per decision.
type roundTrips struct{ n atomic.Int64 }

func connSetup(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}

var _ redis.Hook = (*roundTrips)(nil)

func (c *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if !connSetup(cmd) {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		setup := true
		for _, cmd := range cmds {
			setup = setup && connSetup(cmd)
		}
		if !setup {
			c.n.Add(1)
		}
		return next(ctx, cmds)
	}
}
