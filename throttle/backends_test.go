package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/redis/go-redis/v9"
)

// The same suite runs on miniredis, a real redis-server and a real Redis
// Cluster (bash scripts/test.sh starts both). Real servers keep real time,
// so these tests use hour-long periods: nothing they assert changes in the
// seconds a test takes.

var allAlgorithms = []throttle.Algorithm{throttle.FixedWindow, throttle.SlidingLog, throttle.SlidingWindow, throttle.TokenBucket, throttle.GCRA}

func TestBackendsAlgorithms(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			for _, algo := range allAlgorithms {
				t.Run(string(algo), func(t *testing.T) {
					prefix := redistest.Prefix(t)
					l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
						throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 3}})
					if err != nil {
						t.Fatal(err)
					}
					for i := range 3 {
						res, err := l.Allow(ctx, "s")
						if err != nil || !res.Allowed || res.Remaining != 2-i {
							t.Fatalf("request %d: %+v, %v; want allowed with %d left", i, res, err, 2-i)
						}
					}
					res, err := l.Allow(ctx, "s")
					if err != nil || res.Allowed {
						t.Fatalf("4th request: %+v, %v; want denied", res, err)
					}
					// Within an hour, and no earlier than the fixed window's
					// or bucket's next permit could be.
					if res.RetryAfter <= 0 || res.RetryAfter > time.Hour+3*time.Minute {
						t.Fatalf("RetryAfter %v, want within (0, 1h+precision]", res.RetryAfter)
					}
					if algo != throttle.FixedWindow && res.RetryAfter < 19*time.Minute {
						t.Fatalf("RetryAfter %v, want at least the 20m interval", res.RetryAfter)
					}
					k := prefix + "{s}:r"
					ttl, err := b.Client.PTTL(ctx, k).Result()
					if err != nil || ttl <= 0 || ttl > time.Hour+3*time.Minute {
						t.Fatalf("PTTL %s = %v, %v; want a TTL of at most about an hour", k, ttl, err)
					}
				})
			}
		})
	}
}

// A policy whose rules use every algorithm is decided in one script over
// keys that share a hash slot: no CROSSSLOT on a cluster, all or nothing.
func TestBackendsMixedPolicy(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			var rules []throttle.Rule
			for i, algo := range allAlgorithms {
				rules = append(rules, throttle.Rule{Name: string(algo), Algorithm: algo, Limit: throttle.Limit{Count: 10 + i, Period: time.Hour, Burst: 10 + i}})
			}
			rules[2].Limit = throttle.Limit{Count: 2, Period: time.Hour, Burst: 2} // sliding_window is the tightest
			l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix}, rules...)
			if err != nil {
				t.Fatal(err)
			}
			for _, subject := range []string{"tenant-1", "{tenant}", "a}b{c", "ünï:code\n"} {
				res, err := l.AllowN(ctx, subject, 2)
				if err != nil || !res.Allowed || res.Rule != "sliding_window" || res.Remaining != 0 {
					t.Fatalf("%q: %+v, %v; want allowed, sliding_window with 0 left", subject, res, err)
				}
				res, err = l.Allow(ctx, subject)
				if err != nil || res.Allowed || res.Rule != "sliding_window" {
					t.Fatalf("%q again: %+v, %v; want denied by sliding_window", subject, res, err)
				}
				// The denial charged nothing: the fixed window still has 8 of 10.
				for _, r := range rules {
					k := fmt.Sprintf("%s{%s}:%s", prefix, enc(t, subject), r.Name)
					if n, err := b.Client.Exists(ctx, k).Result(); err != nil || n != 1 {
						t.Fatalf("key %q: exists=%d, %v", k, n, err)
					}
				}
				if c, _ := b.Client.HGet(ctx, fmt.Sprintf("%s{%s}:fixed_window", prefix, enc(t, subject)), "c").Int(); c != 2 {
					t.Fatalf("%q: fixed window counted %d, want 2", subject, c)
				}
			}
		})
	}
}

// Reserve and Cancel against real servers: an hour-long interval makes the
// delays independent of the test's own duration.
func TestBackendsReserveCancel(t *testing.T) {
	eachBucketBackend(t, func(t *testing.T, b redistest.Backend, algo throttle.Algorithm) {
		ctx := context.Background()
		l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)},
			throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 1, Period: time.Hour, Burst: 1}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := l.ReserveN(ctx, "s", 1); err != nil {
			t.Fatal(err)
		}
		r, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r.Delay() < 59*time.Minute || r.Delay() > time.Hour {
			t.Fatalf("second reservation: %v, %v; want a delay of about 1h", r, err)
		}
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		r2, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r2.Delay() > time.Hour {
			t.Fatalf("after Cancel: %v, %v; want the refunded slot, about 1h, not 2h", r2, err)
		}
		// A deadline before the slot: refused, nothing booked.
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if _, err := l.ReserveN(dctx, "s", 1); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Reserve past the deadline: %v, want DeadlineExceeded", err)
		}
	})
}

// FailOpen admits while Redis is down; the default fails closed with an
// error that wraps the cause.
func TestFailOpenAndClosed(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		if b.Mini == nil {
			continue // stopping a shared real server is the reliability suite's job
		}
		ctx := context.Background()
		// No retries: each call fails fast once the server is gone.
		rdb := redis.NewClient(&redis.Options{Addr: b.Mini.Addr(), MaxRetries: -1, DialerRetries: 1})
		defer rdb.Close()
		var reported []bool
		open, _ := throttle.New(rdb, throttle.Options{FailOpen: true, OnRedisError: func(_ error, failedOpen bool) { reported = append(reported, failedOpen) }},
			throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Hour, Burst: 1}})
		closed, _ := throttle.New(rdb, throttle.Options{},
			throttle.Rule{Name: "r", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 1, Period: time.Hour, Burst: 1}})
		b.Mini.Close()
		for range 2 {
			if res, err := open.Allow(ctx, "s"); err != nil || !res.Allowed {
				t.Fatalf("fail-open Allow with Redis down: %+v, %v; want allowed", res, err)
			}
			if err := open.Wait(ctx, "s"); err != nil {
				t.Fatalf("fail-open Wait with Redis down: %v", err)
			}
		}
		if len(reported) != 4 || !reported[0] {
			t.Fatalf("OnRedisError calls %v, want 4 reporting failed open", reported)
		}
		_, err := closed.Allow(ctx, "s")
		if !errors.Is(err, throttle.ErrRedis) {
			t.Fatalf("fail-closed Allow with Redis down: %v, want ErrRedis", err)
		}
		var opErr *net.OpError
		if !errors.As(err, &opErr) || !strings.Contains(err.Error(), "connection refused") {
			t.Fatalf("error %q does not carry its cause", err)
		}
		if err := closed.Wait(ctx, "s"); !errors.Is(err, throttle.ErrRedis) {
			t.Fatalf("fail-closed Wait with Redis down: %v, want ErrRedis", err)
		}
	}
}

func enc(t *testing.T, subject string) string {
	t.Helper()
	s, err := throttle.EncodeSubject(subject)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Wait on real servers, in real time: every waiter is admitted, each with
// one round trip (buckets) or one plus one per refill (windows), and never
// faster than the limit allows. Only lower bounds on time are asserted;
// exact instants are the synctest suite's job.
func TestBackendsWait(t *testing.T) {
	const waiters = 40
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			for _, algo := range allAlgorithms {
				t.Run(string(algo), func(t *testing.T) {
					ctx := context.Background()
					// 10 per 100ms: buckets pace one every 10ms after the
					// first 10; windows admit 10 per window.
					limit := throttle.Limit{Count: 10, Period: 100 * time.Millisecond, Burst: 10}
					l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)},
						throttle.Rule{Name: "r", Algorithm: algo, Limit: limit, Precision: 10 * time.Millisecond})
					if err != nil {
						t.Fatal(err)
					}
					if _, err := l.Allow(ctx, "warm"); err != nil {
						t.Fatal(err)
					}
					calls := &scriptCounter{}
					b.Client.AddHook(calls)
					defer calls.stop()
					start := time.Now()
					errs := make(chan error, waiters)
					for range waiters {
						go func() { errs <- l.Wait(ctx, "s") }()
					}
					for range waiters {
						if err := <-errs; err != nil {
							t.Fatal(err)
						}
					}
					elapsed := time.Since(start)
					// 40 permits at 10 per 100ms, 10 at once: at least 300ms;
					// the fixed window admits its first two tens on either
					// side of a boundary, so 200ms there.
					least := 300 * time.Millisecond
					if algo == throttle.FixedWindow {
						least = 200 * time.Millisecond
					}
					if elapsed < least {
						t.Fatalf("%d permits in %v, faster than the limit allows (≥ %v)", waiters, elapsed, least)
					}
					got := calls.n.Load()
					switch {
					case algo == throttle.TokenBucket || algo == throttle.GCRA:
						if got != waiters {
							t.Fatalf("%d script calls for %d waiters, want one each", got, waiters)
						}
					case algo == throttle.FixedWindow:
						// A whole window frees at once: about one denied call
						// per refill.
						refills := int64(elapsed/(100*time.Millisecond)) + 2
						if got < waiters || got > waiters+refills {
							t.Fatalf("%d script calls for %d waiters over %v, want between %d and %d", got, waiters, elapsed, waiters, waiters+refills)
						}
					default:
						// Sliding windows free permit by permit (log) or
						// bucket by bucket: admissions spread over a few
						// scheduler ticks free in steps, each of which can
						// cost the head one denied call; never more than one
						// per permit.
						if got < waiters || got > 2*waiters {
							t.Fatalf("%d script calls for %d waiters, want between %d and %d", got, waiters, waiters, 2*waiters)
						}
					}
				})
			}
		})
	}
}

// scriptCounter counts script calls until stopped (hooks cannot be removed
// from a shared client, so it stops counting instead).
type scriptCounter struct {
	n       atomic.Int64
	stopped atomic.Bool
}

func (c *scriptCounter) stop()                                       { c.stopped.Store(true) }
func (c *scriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); !c.stopped.Load() && (name == "evalsha" || name == "eval") {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (c *scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestBackendsAdmit books turns ahead under task IDs with every algorithm
// and a mixed policy, on each backend (on a cluster, the rule keys and the
// receipt set share the subject's slot): 3 per hour admit three turns now,
// the fourth is booked ahead (at the next fixed window, or at least the
// 20m interval later for the others), an early return is held, a second Admit of the
// fourth is not booked twice, and the booking lapses into a new turn when
// redeemed.
func TestBackendsAdmit(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			policies := [][]throttle.Rule{{
				{Name: "a", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 3}},
				{Name: "b", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 3}},
			}}
			for _, algo := range allAlgorithms {
				policies = append(policies, []throttle.Rule{{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 3}}})
			}
			for _, rules := range policies {
				t.Run(string(rules[0].Algorithm)+fmt.Sprint("x", len(rules)), func(t *testing.T) {
					l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)}, rules...)
					if err != nil {
						t.Fatal(err)
					}
					req := func(id string, wait time.Duration) throttle.AdmitRequest {
						return throttle.AdmitRequest{Subject: "s", N: 1, Caller: throttle.Caller{ID: id}, Wait: wait, Tolerance: time.Second}
					}
					for i := range 3 {
						if a, err := l.Admit(ctx, req(fmt.Sprint("t", i), 0)); err != nil || a.Status != throttle.Granted {
							t.Fatalf("admit %d: %+v, %v; want granted", i, a, err)
						}
					}
					a, err := l.Admit(ctx, req("t3", 0))
					earliest := 19 * time.Minute // the buckets' interval; a window's end may be sooner
					if rules[0].Algorithm == throttle.FixedWindow {
						earliest = time.Microsecond
					}
					if err != nil || a.Status != throttle.Booked || a.Delay < earliest || a.Delay > time.Hour+3*time.Minute {
						t.Fatalf("4th: %+v, %v; want booked %v to 1h ahead", a, err, earliest)
					}
					// Early: a wait shorter than the turn is away (a fixed
					// window's turn is its end, which the clock may bring
					// within a minute).
					early := min(time.Minute, a.Delay/2)
					again, err := l.Admit(ctx, req("t3", early))
					if err != nil || again.Status != throttle.Held || again.Delay > a.Delay || again.Delay < a.Delay-time.Minute {
						t.Fatalf("4th again, early: %+v, %v; want held for the same turn", again, err)
					}
					if res, err := l.Allow(ctx, "s"); err != nil || res.Allowed || res.RetryAfter < a.Delay-time.Minute {
						t.Fatalf("Allow after the booking: %+v, %v; want denied until after the booked turn", res, err)
					}
					redeemed, err := l.Admit(ctx, req("t3", -1))
					if err != nil || redeemed.Status != throttle.Redeemed {
						t.Fatalf("4th, able to wait: %+v, %v; want redeemed", redeemed, err)
					}
				})
			}
		})
	}
}

// Issue 11 on every backend: an interval that is not a whole number of
// microseconds (7 per hour: 514285714.28…µs) admits its burst at one
// instant with exact counts; n = 0 reads without charging; AllowAtMost
// takes what is left; Reset forgets the subject.
func TestBackendsExactStateAtMostReset(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			for _, algo := range allAlgorithms {
				t.Run(string(algo), func(t *testing.T) {
					l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)},
						throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 7, Period: time.Hour, Burst: 2}})
					if err != nil {
						t.Fatal(err)
					}
					capacity := 2
					if algo != throttle.TokenBucket && algo != throttle.GCRA {
						capacity = 7
					}
					if res, err := l.AllowN(ctx, "s", 0); err != nil || !res.Allowed || res.Remaining != capacity {
						t.Fatalf("AllowN(0) = %+v, %v; want allowed with %d left", res, err, capacity)
					}
					if res, err := l.Allow(ctx, "s"); err != nil || !res.Allowed || res.Remaining != capacity-1 {
						t.Fatalf("Allow = %+v, %v; want allowed with %d left", res, err, capacity-1)
					}
					got, res, err := l.AllowAtMost(ctx, "s", 10)
					if err != nil || got != capacity-1 || res.Remaining != 0 {
						t.Fatalf("AllowAtMost(10) = %d, %+v, %v; want %d, 0 left", got, res, err, capacity-1)
					}
					res, err = l.AllowN(ctx, "s", 0)
					if err != nil || !res.Allowed || res.Remaining != 0 {
						t.Fatalf("AllowN(0) when spent = %+v, %v; want allowed (0 waits for nothing) with 0 left", res, err)
					}
					if got, res, err = l.AllowAtMost(ctx, "s", 1); err != nil || got != 0 || res.Allowed || res.RetryAfter <= 0 {
						t.Fatalf("AllowAtMost(1) when spent = %d, %+v, %v; want 0 and a RetryAfter", got, res, err)
					}
					if algo == throttle.TokenBucket || algo == throttle.GCRA {
						// The next permit: one interval after the first, rounded up.
						iv := time.Hour / 7
						if res.RetryAfter > iv+time.Microsecond || res.RetryAfter < iv-time.Minute {
							t.Fatalf("RetryAfter %v, want just under %v", res.RetryAfter, iv+time.Microsecond)
						}
					}
					if err := l.Reset(ctx, "s"); err != nil {
						t.Fatal(err)
					}
					if res, err := l.AllowN(ctx, "s", capacity); err != nil || !res.Allowed {
						t.Fatalf("AllowN(%d) after Reset = %+v, %v; want allowed", capacity, res, err)
					}
				})
			}
		})
	}
}

// Issue 20 on every backend: a reservation made before Reset gives
// nothing back into the state after it, by Cancel or by a Settle for less,
// under every algorithm; the record of the Reset (<rule>!reset) has a TTL
// no longer than the forgotten state could matter. A bucket's reservation
// lies ahead (a bucket gives back only before its time to act), a
// window's is counted now.
func TestBackendsResetRefundsNothing(t *testing.T) {
	give := map[string]func(context.Context, *throttle.Reservation) error{
		"Cancel": func(ctx context.Context, r *throttle.Reservation) error { return r.Cancel(ctx) },
		"Settle": func(ctx context.Context, r *throttle.Reservation) error { return r.Settle(ctx, 0) },
	}
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			for _, algo := range allAlgorithms {
				for _, path := range []string{"Cancel", "Settle"} {
					t.Run(string(algo)+"/"+path, func(t *testing.T) {
						prefix := redistest.Prefix(t)
						l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
							throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 5, Period: time.Hour, Burst: 5}})
						if err != nil {
							t.Fatal(err)
						}
						bucket := algo == throttle.TokenBucket || algo == throttle.GCRA
						if bucket {
							admittedOf(t, l, 5)
						}
						r, err := l.ReserveN(ctx, "s", 2)
						if err != nil {
							t.Fatal(err)
						}
						if err := l.Reset(ctx, "s"); err != nil {
							t.Fatal(err)
						}
						if got := admittedOf(t, l, 10); got != 5 {
							t.Fatalf("%d admitted after Reset, want 5", got)
						}
						if err := give[path](ctx, r); err != nil {
							t.Fatal(err)
						}
						if got := admittedOf(t, l, 10); got != 0 {
							t.Fatalf("%s after Reset gave %d back into the new state, want 0", path, got)
						}
						ttl, err := b.Client.PTTL(ctx, prefix+"{s}:r!reset").Result()
						if limit := 3*time.Hour + 30*time.Minute; err != nil || ttl <= 0 || ttl > limit {
							t.Fatalf("PTTL of the record of the Reset = %v, %v; want within (0, %v]", ttl, err, limit)
						}
					})
				}
			}
		})
	}
}

// admittedOf counts how many of k Allow calls on subject "s" succeed.
func admittedOf(t *testing.T, l *throttle.Limiter, k int) int {
	t.Helper()
	got := 0
	for range k {
		res, err := l.Allow(context.Background(), "s")
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			got++
		}
	}
	return got
}

// One permit from a full bucket leaves the integer form of the state
// (lua/bucket.lua): the TAT alone, in decimal, which a real Redis keeps as
// an integer inside its object header (OBJECT ENCODING "int"), 16 bytes
// less than any other string. Two permits leave the 12-byte form; a
// refund of the second gives the integer form back.
func TestBackendsBucketIntegerState(t *testing.T) {
	eachBucketBackend(t, func(t *testing.T, b redistest.Backend, algo throttle.Algorithm) {
		ctx := context.Background()
		prefix := redistest.Prefix(t)
		l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "r", Algorithm: algo, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 3}})
		if err != nil {
			t.Fatal(err)
		}
		k := prefix + "{s}:r"
		if b.Mini != nil {
			// Redis's clock stands still, so that the refund
			// below comes before the permit's time to act.
			b.Mini.SetTime(time.Now())
		}
		integer := func(when string) {
			t.Helper()
			v, err := b.Client.Get(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			tat, err := strconv.ParseInt(v, 10, 64)
			now, terr := b.Client.Time(ctx).Result()
			if err != nil || terr != nil || tat < now.UnixMicro() || tat > now.Add(20*time.Minute).UnixMicro() {
				t.Fatalf("%s: state %q (Redis time %v); want the TAT, 20m ahead, in decimal", when, v, now)
			}
			if b.Mini == nil {
				if enc, err := b.Client.ObjectEncoding(ctx, k).Result(); err != nil || enc != "int" {
					t.Fatalf("%s: OBJECT ENCODING = %q, %v; want int", when, enc, err)
				}
			}
		}
		if res, err := l.Allow(ctx, "s"); err != nil || !res.Allowed {
			t.Fatalf("Allow = %+v, %v", res, err)
		}
		integer("after one permit")
		r, err := l.ReserveN(ctx, "s", 1)
		if err != nil || r.Delay() != 0 {
			t.Fatalf("Reserve = %v, %v; want a permit now", r, err)
		}
		if v, _ := b.Client.Get(ctx, k).Result(); len(v) != 12 {
			t.Fatalf("after two permits: state %q; want the 12-byte form", v)
		}
		if err := r.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		if b.Mini != nil { // a refund needs its time to act not passed: a real server's clock moves on
			integer("after the second was refunded")
		}
	})
}

// eachBucketBackend runs f for the token bucket and GCRA on every backend
// (miniredis, and the real servers the environment names), each a subtest.
func eachBucketBackend(t *testing.T, f func(t *testing.T, b redistest.Backend, algo throttle.Algorithm)) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			for _, algo := range []throttle.Algorithm{throttle.TokenBucket, throttle.GCRA} {
				t.Run(string(algo), func(t *testing.T) { f(t, b, algo) })
			}
		})
	}
}

// Rules over several subjects on real servers (a cluster's subjects in
// different slots): a request the global subject holds back is charged to
// the tenant's at the turn it acts, so the tenant's acts keep its own
// rule. Hour-long periods make the turns independent of the test's own
// duration.
func TestBackendsSubjectsMeet(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		for _, tenant := range []throttle.Rule{
			{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 4, Period: time.Hour, Burst: 1}},
			{Name: "tenant", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 2, Period: time.Hour}},
		} {
			t.Run(b.Name+"/"+string(tenant.Algorithm), func(t *testing.T) {
				ctx := context.Background()
				l, err := throttle.New(b.Client, throttle.Options{Prefix: redistest.Prefix(t)}, tenant,
					throttle.Rule{Name: "global", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 10, Period: time.Hour, Burst: 1}, Subject: "all"})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				act := func(subject string) time.Duration {
					r, err := l.ReserveN(ctx, subject, 1)
					if err != nil {
						t.Fatalf("ReserveN(%s): %v", subject, err)
					}
					return r.Delay()
				}
				acts := []time.Duration{act("a")}
				for i := range 9 { // the global rule booked an hour ahead
					act(fmt.Sprintf("b%d", i))
				}
				for range 3 {
					acts = append(acts, act("a"))
				}
				const slack = time.Second // the test's own running time
				for i := 1; i < len(acts); i++ {
					if tenant.Algorithm == throttle.GCRA && acts[i]-acts[i-1] < 15*time.Minute-slack {
						t.Fatalf("tenant acts at %v: two %v apart, under its 15m", acts, acts[i]-acts[i-1])
					}
					if i >= 2 && tenant.Algorithm == throttle.SlidingLog && acts[i]-acts[i-2] < time.Hour-slack {
						t.Fatalf("tenant acts at %v: 3 within %v, over its 2 an hour", acts, acts[i]-acts[i-2])
					}
				}
			})
		}
	}
}
