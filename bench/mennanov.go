package main

import (
	"context"
	"errors"
	"math"
	"sync"
	"time"

	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/mennanov/limiters"
	"github.com/redis/go-redis/v9"
)

// github.com/mennanov/limiters (v1.11.0), its Redis token bucket and
// leaky bucket. Each is one Go object per key, holding a redsync lock (SET
// NX to take it, a script to release it) around a read of the state
// (MGET; GET) and its write (MULTI SET SET EXEC; SET): four round trips per
// decision, on the client's clock. Every process builds the same keys for
// a key, so processes share the limit through Redis.
//
// The lock's retries: redsync's defaults (32 tries, 50–250 ms apart)
// would leave a process that found the lock taken asleep for most of a
// 5 ms slot at R = 200/s, so the lock is retried every 1–2 ms instead, up
// to its expiry (8 s): the setting that serves this library's waits best.

// mennanovLockDelay is the pause between two tries to take a key's lock.
func mennanovLockDelay(tries int) time.Duration {
	return time.Millisecond + time.Duration(tries%2)*time.Millisecond
}

// mennanovKeys builds each key's limiter once per process.
type mennanovKeys[L any] struct {
	mu   sync.Mutex
	keys map[string]L
	make func(key string) L
}

func (m *mennanovKeys[L]) get(key string) L {
	m.mu.Lock()
	defer m.mu.Unlock()
	if l, ok := m.keys[key]; ok {
		return l
	}
	l := m.make(key)
	m.keys[key] = l
	return l
}

// mennanovTokenBucket is limiters.TokenBucket with capacity burst, one
// token per 1/R, and the loop its users write for Wait: Take 1; if the
// bucket is short, sleep the time it names, repeat.
type mennanovTokenBucket struct {
	keys *mennanovKeys[*limiters.TokenBucket]
}

var _ Waiter = mennanovTokenBucket{}
var _ Allower = mennanovTokenBucket{}

func newMennanovTokenBucket(rdb redis.UniversalClient, r, burst int) mennanovTokenBucket {
	return newMennanovTokenBucketEvery(rdb, time.Second/time.Duration(r), burst)
}

// newMennanovTokenBucketEvery is the token bucket of one token per
// interval.
func newMennanovTokenBucketEvery(rdb redis.UniversalClient, interval time.Duration, burst int) mennanovTokenBucket {
	pool := goredis.NewPool(rdb)
	return mennanovTokenBucket{&mennanovKeys[*limiters.TokenBucket]{keys: map[string]*limiters.TokenBucket{}, make: func(key string) *limiters.TokenBucket {
		lock := limiters.NewLockRedis(pool, "mn:tb:lock:"+key, redsync.WithRetryDelayFunc(mennanovLockDelay), redsync.WithTries(math.MaxInt32))
		// The state lives as long as a full refill takes, as redis_rate's.
		ttl := interval * time.Duration(burst+1)
		backend := limiters.NewTokenBucketRedis(rdb, "mn:tb:"+key, ttl, false)
		return limiters.NewTokenBucket(int64(burst), interval, lock, backend, limiters.NewSystemClock(), limiters.NewStdLogger())
	}}}
}

func (m mennanovTokenBucket) Wait(ctx context.Context, key string) error {
	tb := m.keys.get(key)
	for {
		d, err := tb.Limit(ctx)
		if err == nil {
			return nil
		}
		if !errors.Is(err, limiters.ErrLimitExhausted) {
			return err
		}
		if err := sleepCtx(ctx, d); err != nil {
			return err
		}
	}
}

func (m mennanovTokenBucket) Allow(ctx context.Context, key string) (bool, error) {
	_, err := m.keys.get(key).Limit(ctx)
	if errors.Is(err, limiters.ErrLimitExhausted) {
		return false, nil
	}
	return err == nil, err
}

// mennanovLeakyBucket is limiters.LeakyBucket used as a queue, its
// strongest Wait: Limit books the next slot, 1/R after the last one, and
// names the time until it; the caller sleeps that long. Its capacity (the
// slots it books ahead) is set far beyond any queue here, so it never
// refuses and every permit is one decision. A leaky bucket has no burst:
// slots are 1/R apart from the first.
type mennanovLeakyBucket struct {
	keys *mennanovKeys[*limiters.LeakyBucket]
}

var _ Waiter = mennanovLeakyBucket{}

func newMennanovLeakyBucket(rdb redis.UniversalClient, r, _ int) mennanovLeakyBucket {
	pool := goredis.NewPool(rdb)
	interval := time.Second / time.Duration(r)
	return mennanovLeakyBucket{&mennanovKeys[*limiters.LeakyBucket]{keys: map[string]*limiters.LeakyBucket{}, make: func(key string) *limiters.LeakyBucket {
		lock := limiters.NewLockRedis(pool, "mn:lb:lock:"+key, redsync.WithRetryDelayFunc(mennanovLockDelay), redsync.WithTries(math.MaxInt32))
		// The state (the last slot booked) must outlive the queue.
		backend := limiters.NewLeakyBucketRedis(rdb, "mn:lb:"+key, time.Minute, false)
		return limiters.NewLeakyBucket(math.MaxInt32, interval, lock, backend, limiters.NewSystemClock(), limiters.NewStdLogger())
	}}}
}

func (m mennanovLeakyBucket) Wait(ctx context.Context, key string) error {
	d, err := m.keys.get(key).Limit(ctx)
	if err != nil {
		return err
	}
	return sleepCtx(ctx, d)
}
