package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// memoryResult is the Redis memory one key costs, for one algorithm and
// state.
type memoryResult struct {
	Impl  string `json:"impl"`
	State string `json:"state"` // what each key holds
	Keys  int    `json:"keys"`
	// UsedMemoryDelta is INFO used_memory after minus before writing Keys
	// keys (on a flushed server), less the change in mem_clients_normal
	// (connection buffers); BytesPerKey is it over Keys.
	UsedMemoryDelta int64   `json:"used_memory_delta"`
	BytesPerKey     float64 `json:"bytes_per_key"`
	// MemoryUsage is MEMORY USAGE (SAMPLES 0) of one representative key,
	// and Encoding its OBJECT ENCODING.
	MemoryUsage int64  `json:"memory_usage"`
	Encoding    string `json:"encoding"`
	// ProjectedMB1M is BytesPerKey × 1M, in MB (10^6 bytes).
	ProjectedMB1M float64 `json:"projected_mb_1m"`
	// DesignMB1M is the estimate in DESIGN.md for 1M keys, if it gives one.
	DesignMB1M float64 `json:"design_mb_1m,omitempty"`
	Errors     int64   `json:"errors"`
}

// memCase writes one key per subject and names the key it wrote.
type memCase struct {
	impl, state string
	keys        int
	design      float64
	write       func(ctx context.Context, subject string) error
	key         func(subject string) string
}

// The limit for the memory cases: long enough that no key expires while
// 100k are written (a 200/s bucket's key lives 5 ms after one permit).
var memLimit = throttle.Limit{Count: 200, Period: 24 * time.Hour, Burst: 200}

func memCases(r *runner) ([]memCase, error) {
	var cases []memCase
	for _, a := range []throttle.Algorithm{throttle.TokenBucket, throttle.GCRA, throttle.FixedWindow, throttle.SlidingWindow, throttle.SlidingLog} {
		// The default prefix, as redis_rate below has its own ("rate:"):
		// each library's keys as a user gets them.
		l, err := throttle.New(r.rdb, throttle.Options{}, throttle.Rule{Name: "r", Algorithm: a, Limit: memLimit})
		if err != nil {
			return nil, err
		}
		design := 0.0
		if a == throttle.TokenBucket {
			design = 20
		}
		key := func(s string) string { return throttle.DefaultPrefix + "{" + s + "}:r" }
		cases = append(cases, memCase{impl: "jobthrottle/" + string(a), state: "after 1 permit", keys: 100_000, design: design,
			write: func(ctx context.Context, s string) error { _, err := l.Allow(ctx, s); return err }, key: key})
		if a == throttle.SlidingLog {
			cases = append(cases, memCase{impl: "jobthrottle/" + string(a), state: fmt.Sprintf("full: %d permits", memLimit.Count), keys: 10_000, design: 1000,
				write: func(ctx context.Context, s string) error { _, err := l.AllowN(ctx, s, memLimit.Count); return err }, key: key})
		}
	}
	mn := newMennanovTokenBucketEvery(r.rdb, memLimit.Period/time.Duration(memLimit.Count), memLimit.Burst)
	mnState := mn.keys.make // one limiter per subject, used once
	cases = append(cases, memCase{impl: "mennanov/token_bucket", state: "after 1 permit (2 keys)", keys: 100_000,
		write: func(ctx context.Context, s string) error { _, err := mnState(s).Limit(ctx); return err },
		key:   func(s string) string { return "{mn:tb:" + s + "}available" }})
	rl := redis_rate.NewLimiter(r.rdb)
	lim := redis_rate.Limit{Rate: memLimit.Count, Burst: memLimit.Burst, Period: memLimit.Period}
	cases = append(cases, memCase{impl: "redis_rate", state: "after 1 permit", keys: 100_000,
		write: func(ctx context.Context, s string) error { _, err := rl.Allow(ctx, s, lim); return err },
		key:   func(s string) string { return "rate:" + s }})
	return cases, nil
}

// runMemory measures each case on a flushed server.
func (r *runner) runMemory(ctx context.Context, scale float64) ([]memoryResult, error) {
	cases, err := memCases(r)
	if err != nil {
		return nil, err
	}
	var out []memoryResult
	for _, c := range cases {
		n := max(int(float64(c.keys)*scale), 100)
		if err := r.rdb.FlushAll(ctx).Err(); err != nil {
			return nil, err
		}
		time.Sleep(200 * time.Millisecond) // let lazy frees settle
		before, err := readStats(ctx, r.rdb)
		if err != nil {
			return nil, err
		}
		var errs atomic.Int64
		var next atomic.Int64
		var wg sync.WaitGroup
		for range 50 {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= int64(n) {
						return
					}
					if err := c.write(ctx, fmt.Sprintf("k%07d", i)); err != nil {
						errs.Add(1)
					}
				}
			})
		}
		wg.Wait()
		// Let the key dictionaries finish growing: a dictionary that is
		// rehashing holds its old table beside the new one, 0.5 MB for
		// 65 536 buckets, 5 B a key here, gone within a few serverCron
		// ticks. Read at once, that transient made the same key measure
		// 147 B in one run and 152 B in the next.
		time.Sleep(time.Second)
		after, err := readStats(ctx, r.rdb)
		if err != nil {
			return nil, err
		}
		k := c.key("k0000042")
		usage, _ := r.rdb.MemoryUsage(ctx, k, 0).Result()
		enc, _ := r.rdb.ObjectEncoding(ctx, k).Result()
		// The keys' bytes: used_memory less the connections' buffers, which
		// the 50 writers' pipelines grow and Redis shrinks only once they
		// have been idle for seconds.
		delta := (after.Memory - after.ClientMemory) - (before.Memory - before.ClientMemory)
		res := memoryResult{Impl: c.impl, State: c.state, Keys: n, UsedMemoryDelta: delta,
			BytesPerKey: float64(delta) / float64(n), MemoryUsage: usage, Encoding: enc,
			DesignMB1M: c.design, Errors: errs.Load()}
		res.ProjectedMB1M = res.BytesPerKey * 1e6 / 1e6
		r.logf("memory %-28s %-18s %7d keys: %6.0f B/key (MEMORY USAGE %d, %s)", c.impl, c.state, n, res.BytesPerKey, usage, enc)
		out = append(out, res)
	}
	return out, r.rdb.FlushAll(ctx).Err()
}
