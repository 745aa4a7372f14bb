package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// workload is what one benchmark process runs. The parent passes it to each
// child as JSON after -child.
type workload struct {
	Mode          string        `json:"mode"` // "wait" or "allow"
	Impl          string        `json:"impl"`
	Addr          string        `json:"addr"` // Redis; empty for in-process implementations
	Rate          int           `json:"rate"`
	Burst         int           `json:"burst"`
	Waiters       int           `json:"waiters"` // goroutines in this process
	Key           string        `json:"key"`     // the shared key (wait mode)
	Keys          int           `json:"keys"`    // distinct keys (allow mode)
	StartUnixNano int64         `json:"start_unix_nano"`
	Duration      time.Duration `json:"duration"`
	// The leased part's "hot" mode (leased.go).
	HotOp   string        `json:"hot_op,omitempty"`      // wait, or allow
	LeaseNs time.Duration `json:"local_lease,omitempty"` // throttle.Options.LocalLease
	File    string        `json:"file,omitempty"`        // where admissions are recorded
	Linger  time.Duration `json:"linger,omitempty"`      // stay alive this long after Duration
	PaceNs  time.Duration `json:"pace,omitempty"`        // sleep after each admission
	// Apart: a burn process run as another session's work (nice 0).
	Apart bool `json:"apart,omitempty"`
}

// procResult is what one process reports back.
type procResult struct {
	// Admissions[i] holds waiter i's admission times, nanoseconds after
	// the start (wall clock, so processes agree).
	Admissions [][]int64 `json:"admissions,omitempty"`
	// RedisUs holds, if RedisClock, the Redis time (µs of Redis TIME) of
	// every permit admitted in this process, from the driver script's
	// replies (redisclock.go), sorted.
	RedisClock bool    `json:"redis_clock,omitempty"`
	RedisUs    []int64 `json:"redis_us,omitempty"`
	// WaitNs is how long each Wait call took, nanoseconds.
	WaitNs     []int64 `json:"wait_ns,omitempty"`
	RoundTrips int64   `json:"round_trips"`
	CPUNs      int64   `json:"cpu_ns"` // this process's user+sys CPU from start to end
	Ops        int64   `json:"ops,omitempty"`
	Allowed    int64   `json:"allowed,omitempty"`
	ElapsedNs  int64   `json:"elapsed_ns"`
	LateNs     int64   `json:"late_ns"` // how far past the start this process was ready
	Errors     int64   `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
	// ScriptOps counts the driver script's calls by operation (the leased
	// part's children only).
	ScriptOps map[string]int64 `json:"script_ops,omitempty"`
	// Lease is what a leased part's child saw of its leases and its
	// scheduler (leased_probe.go).
	Lease *leaseStats `json:"lease,omitempty"`
}

// childMain runs one workload given as JSON and writes the result as JSON.
func childMain(spec string, out io.Writer) error {
	var w workload
	if err := json.Unmarshal([]byte(spec), &w); err != nil {
		return fmt.Errorf("bench: child spec: %w", err)
	}
	res, err := runWorkload(w)
	if err != nil {
		return err
	}
	return json.NewEncoder(out).Encode(res)
}

// runWorkload connects, waits for the start time, runs the workload and
// returns what it measured.
func runWorkload(w workload) (*procResult, error) {
	if w.Mode == "burn" {
		return burn(w), nil
	}
	if w.Mode == "hot" {
		return runHot(w)
	}
	im, err := implByName(w.Impl)
	if err != nil {
		return nil, err
	}
	var rdb *redis.Client
	var rt roundTrips
	var clk *redisClock
	if im.Redis {
		rdb = redis.NewClient(&redis.Options{Addr: w.Addr})
		defer rdb.Close()
		// Open the pool's connections before the start, so that dialing
		// is not part of the measurement.
		var wg sync.WaitGroup
		for range min(max(w.Waiters, 1), 10) {
			wg.Go(func() { rdb.Ping(context.Background()) })
		}
		wg.Wait()
		rdb.AddHook(&rt)
		// Wait scenarios only: the throughput scenario's millions of
		// decisions need no Redis time, and recording them would cost it.
		if im.Driver && w.Mode == "wait" {
			clk = &redisClock{}
			rdb.AddHook(clk)
		}
	}
	var lim Waiter
	if rdb != nil {
		lim, err = im.New(rdb, w.Rate, w.Burst)
	} else {
		lim, err = im.New(nil, w.Rate, w.Burst)
	}
	if err != nil {
		return nil, err
	}
	start := time.Unix(0, w.StartUnixNano)
	end := start.Add(w.Duration)
	// A hard stop, far past the end: a stuck implementation fails its
	// scenario instead of hanging the run.
	ctx, cancel := context.WithDeadline(context.Background(), end.Add(60*time.Second))
	defer cancel()

	res := &procResult{}
	var errs atomic.Int64
	var firstErr atomic.Value
	fail := func(err error) {
		if errs.Add(1) == 1 {
			firstErr.Store(err.Error())
		}
	}
	if d := time.Until(start); d > 0 {
		time.Sleep(d)
	} else {
		res.LateNs = -d.Nanoseconds()
	}
	cpu0 := cpuTime()
	t0 := time.Now()
	var wg sync.WaitGroup
	switch w.Mode {
	case "wait":
		res.Admissions = make([][]int64, w.Waiters)
		waits := make([][]int64, w.Waiters)
		for i := range w.Waiters {
			wg.Go(func() {
				for {
					a := time.Now()
					if !a.Before(end) {
						return
					}
					if err := lim.Wait(ctx, w.Key); err != nil {
						fail(err)
						if ctx.Err() != nil {
							return
						}
						continue
					}
					b := time.Now()
					res.Admissions[i] = append(res.Admissions[i], b.UnixNano()-w.StartUnixNano)
					waits[i] = append(waits[i], b.Sub(a).Nanoseconds())
				}
			})
		}
		wg.Wait()
		for _, ws := range waits {
			res.WaitNs = append(res.WaitNs, ws...)
		}
	case "allow":
		al, ok := lim.(Allower)
		if !ok {
			return nil, fmt.Errorf("bench: %s has no Allow", w.Impl)
		}
		var ops, allowed atomic.Int64
		for g := range w.Waiters {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(g), uint64(w.StartUnixNano)))
				for time.Now().Before(end) {
					key := w.Key + ":" + strconv.Itoa(r.IntN(w.Keys))
					ok, err := al.Allow(ctx, key)
					if err != nil {
						fail(err)
						continue
					}
					ops.Add(1)
					if ok {
						allowed.Add(1)
					}
				}
			})
		}
		wg.Wait()
		res.Ops, res.Allowed = ops.Load(), allowed.Load()
	default:
		return nil, fmt.Errorf("bench: unknown mode %q", w.Mode)
	}
	res.ElapsedNs = time.Since(t0).Nanoseconds()
	res.CPUNs = cpuTime() - cpu0
	res.RoundTrips = rt.n.Load()
	if clk != nil {
		res.RedisClock, res.RedisUs = true, clk.sorted()
	}
	res.Errors = errs.Load()
	if s, ok := firstErr.Load().(string); ok {
		res.FirstError = s
	}
	return res, nil
}

// burn keeps w.Waiters goroutines spinning from the start for w.Duration:
// the jitter lab's stand-in for other work on the machine.
func burn(w workload) *procResult {
	start := time.Unix(0, w.StartUnixNano)
	end := start.Add(w.Duration)
	if w.Apart {
		_, _ = renice(0)
	}
	time.Sleep(time.Until(start))
	var wg sync.WaitGroup
	var sink atomic.Int64
	for range w.Waiters {
		wg.Go(func() {
			x := int64(0)
			for time.Now().Before(end) {
				for i := range 10_000 {
					x += int64(i) ^ x>>3
				}
			}
			sink.Add(x)
		})
	}
	wg.Wait()
	return &procResult{}
}
