package throttle

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// pauseCases are one rule of each algorithm, with the instants a paused
// rule admits its first and second permit after a pause of 2 s taken at
// 0 (the bubble starts on a second boundary). Buckets resume at the steady
// rate; windows resume with what they counted, here nothing.
var pauseCases = []struct {
	name          string
	rule          Rule
	first, second time.Duration
}{
	{"gcra", Rule{Name: "r", Algorithm: GCRA, Limit: PerSecond(4)}, 2 * time.Second, 2250 * ms},
	{"token_bucket", Rule{Name: "r", Algorithm: TokenBucket, Limit: PerSecond(4)}, 2 * time.Second, 2250 * ms},
	{"fixed_window", Rule{Name: "r", Algorithm: FixedWindow, Limit: PerSecond(4)}, 2 * time.Second, 2 * time.Second},
	{"sliding_log", Rule{Name: "r", Algorithm: SlidingLog, Limit: PerSecond(4)}, 2 * time.Second, 2 * time.Second},
	{"sliding_window", Rule{Name: "r", Algorithm: SlidingWindow, Limit: PerSecond(4), Precision: 100 * ms}, 2 * time.Second, 2 * time.Second},
}

func TestPauseForEveryAlgorithm(t *testing.T) {
	for _, c := range pauseCases {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, c.rule)
				// One permit taken before the pause: the rules are not empty.
				if !allow(t, l, "s", 1).Allowed {
					t.Fatal("first permit denied")
				}
				if _, err := l.PauseFor(ctx, "s", 2*time.Second); err != nil {
					t.Fatalf("PauseFor: %v", err)
				}
				for _, probe := range []time.Duration{0, 1 * time.Second, c.first - time.Microsecond} {
					time.Sleep(probe - at())
					res := allow(t, l, "s", 1)
					if res.Allowed {
						t.Fatalf("admitted at %v, during the pause to %v", probe, c.first)
					}
					if got, want := res.RetryAfter, c.first-probe; got != want {
						t.Errorf("at %v: RetryAfter = %v, want %v", probe, got, want)
					}
					if res.Remaining != 0 {
						t.Errorf("at %v: Remaining = %d, want 0", probe, res.Remaining)
					}
				}
				if left, err := l.PauseFor(ctx, "s", 0); err != nil || left > time.Millisecond {
					t.Errorf("Paused 1µs before the end = %v, %v; want at most 1ms, nil", left, err)
				}
				time.Sleep(c.first - at())
				if !allow(t, l, "s", 1).Allowed {
					t.Fatalf("denied at %v, when the pause is over", c.first)
				}
				if left, err := l.PauseFor(ctx, "s", 0); err != nil || left != 0 {
					t.Errorf("Paused after the end = %v, %v; want 0, nil", left, err)
				}
				time.Sleep(c.second - at())
				if !allow(t, l, "s", 1).Allowed {
					t.Fatalf("second permit after the pause denied at %v", c.second)
				}
				// Normal after: the rule's own limit applies again.
				if c.rule.Algorithm.bucket() {
					if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != 250*ms {
						t.Errorf("third permit at %v: allowed=%v RetryAfter=%v; want denied, 250ms", at(), res.Allowed, res.RetryAfter)
					}
				} else if got := admitted(t, l, "s", 5); got != 2 {
					t.Errorf("window after the pause admitted %d more of 5, want 2 (4 per second)", got)
				}
			})
		})
	}
}

// A reservation asked for during a pause is booked after it, in one round
// trip, and reservations keep their arrival order.
func TestPauseReserveBooksAfterThePause(t *testing.T) {
	for _, a := range []Algorithm{GCRA, TokenBucket} {
		t.Run(string(a), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: a, Limit: PerSecond(10).WithBurst(5)})
				warm(t, l)
				if _, err := l.PauseFor(ctx, "s", 3*time.Second); err != nil {
					t.Fatal(err)
				}
				calls := countScripts(rdb)
				for i := range 3 {
					r, err := l.ReserveN(ctx, "s", 1)
					if err != nil {
						t.Fatal(err)
					}
					if got, want := r.Delay(), 3*time.Second+time.Duration(i)*100*ms; got != want {
						t.Errorf("reservation %d: Delay = %v, want %v", i, got, want)
					}
				}
				if got := calls.Load(); got != 3 {
					t.Errorf("%d script calls for 3 reservations, want 3", got)
				}
				start := at()
				if err := l.Wait(ctx, "s"); err != nil {
					t.Fatal(err)
				}
				if got, want := at()-start, 3300*ms; got != want {
					t.Errorf("Wait during the pause returned after %v, want %v", got, want)
				}
			})
		})
	}
}

// Cancelling a reservation booked before the pause gives nothing back
// before the pause ends.
func TestPauseRefundCannotBreakThePause(t *testing.T) {
	for _, c := range pauseCases {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				ctx := context.Background()
				l := mustNew(t, rdb, Options{}, c.rule)
				var held []*Reservation
				for range 3 {
					r, err := l.acquire(ctx, "s", 1)
					if err != nil {
						t.Fatal(err)
					}
					held = append(held, r)
				}
				if _, err := l.PauseFor(ctx, "s", 2*time.Second); err != nil {
					t.Fatal(err)
				}
				time.Sleep(500 * ms)
				for _, r := range held {
					if err := r.Cancel(ctx); err != nil {
						t.Fatalf("Cancel: %v", err)
					}
				}
				if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != c.first-500*ms {
					t.Errorf("after refunds at 500ms: allowed=%v RetryAfter=%v; want denied, %v", res.Allowed, res.RetryAfter, c.first-500*ms)
				}
			})
		})
	}
}

// A shorter pause never shortens a longer one; a longer one extends it.
func TestPauseOnlyExtends(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, pauseCases[0].rule, Rule{Name: "w", Algorithm: FixedWindow, Limit: Limit{Count: 100, Period: time.Minute, Burst: 100}})
		steps := []struct {
			pause, want time.Duration
		}{
			{5 * time.Second, 5 * time.Second},
			{1 * time.Second, 5 * time.Second},
			{0, 5 * time.Second},
			{-time.Second, 5 * time.Second},
			{7 * time.Second, 7 * time.Second},
		}
		for _, s := range steps {
			if _, err := l.PauseFor(ctx, "s", s.pause); err != nil {
				t.Fatal(err)
			}
			left, err := l.PauseFor(ctx, "s", 0)
			if err != nil || left != s.want {
				t.Errorf("after PauseFor(%v): Paused = %v, %v; want %v", s.pause, left, err, s.want)
			}
			if res := allow(t, l, "s", 1); res.Allowed || res.RetryAfter != s.want {
				t.Errorf("after PauseFor(%v): allowed=%v RetryAfter=%v; want denied, %v", s.pause, res.Allowed, res.RetryAfter, s.want)
			}
		}
		// Other subjects are not paused.
		if !allow(t, l, "other", 1).Allowed {
			t.Error("another subject is paused too")
		}
	})
}

func TestPauseForErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, pauseCases[0].rule)
		if _, err := l.PauseFor(ctx, "", time.Second); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("empty subject: %v, want ErrInvalidSubject", err)
		}
		if _, err := l.PauseFor(ctx, "s", maxPause+1); err == nil {
			t.Error("pause above maxPause accepted")
		}
		if _, err := l.PauseFor(ctx, "", 0); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("Paused with empty subject: %v, want ErrInvalidSubject", err)
		}
		l = mustNew(t, downClient(t), Options{}, pauseCases[0].rule)
		if _, err := l.PauseFor(ctx, "s", time.Second); !errors.Is(err, ErrRedis) {
			t.Errorf("Redis down: %v, want ErrRedis", err)
		}
		if _, err := l.PauseFor(ctx, "s", 0); !errors.Is(err, ErrRedis) {
			t.Errorf("Paused with Redis down: %v, want ErrRedis", err)
		}
	})
}

// The pause key can never be a rule's key, whatever the rule is called.
func TestPauseKeyIsNoRuleKey(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "!pause", Algorithm: GCRA, Limit: PerSecond(1)},
			Rule{Name: "!receipts", Algorithm: GCRA, Limit: PerSecond(1)})
		if _, err := l.PauseFor(ctx, "s", time.Second); err != nil {
			t.Fatal(err)
		}
		keys, err := rdb.Keys(ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{"jobthrottle:{s}:%21pause": true, "jobthrottle:{s}:%21receipts": true, "jobthrottle:{s}:!pause": true}
		if len(keys) != len(want) {
			t.Fatalf("keys = %v, want %v", keys, want)
		}
		for _, k := range keys {
			if !want[k] {
				t.Errorf("unexpected key %q", k)
			}
		}
	})
}

// downClient returns a client whose every dial fails, as with Redis down.
func downClient(t *testing.T) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr:       "127.0.0.1:0",
		MaxRetries: -1,
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			return nil, errors.New("connection refused (test)")
		},
	})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Paused reads the pause's end from the key's value, not its TTL, so a
// server that does not expire keys on its own clock (miniredis without
// FastForward) reports a pause over when it is.
func TestPausedFollowsRedisTime(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	l := mustNew(t, rdb, Options{}, pauseCases[0].rule)
	ctx := context.Background()
	if _, err := l.PauseFor(ctx, "s", time.Hour); err != nil {
		t.Fatal(err)
	}
	m.SetTime(time.Now().Add(time.Hour - time.Second))
	if left, err := l.PauseFor(ctx, "s", 0); err != nil || left <= 0 || left > time.Second {
		t.Errorf("an hour later less a second: Paused = %v, %v; want about 1s", left, err)
	}
	m.SetTime(time.Now().Add(time.Hour + time.Second))
	if left, err := l.PauseFor(ctx, "s", 0); err != nil || left != 0 {
		t.Errorf("after the pause: Paused = %v, %v; want 0", left, err)
	}
}
