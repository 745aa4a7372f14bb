package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// step is one moment of a scripted scenario: at the given offset from the
// start, ask for n permits and expect the outcome.
type step struct {
	at         time.Duration
	n          int
	allowed    bool
	retryAfter time.Duration // checked when denied
	remaining  int
	rule       string // the deciding rule; "" skips the check
}

// play runs the steps in virtual time against a fresh limiter.
func play(t *testing.T, rules []Rule, steps []step) {
	t.Helper()
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, rules...)
		for i, s := range steps {
			time.Sleep(s.at - at())
			res := allow(t, l, "s", s.n)
			if res.Allowed != s.allowed || res.Remaining != s.remaining ||
				(!s.allowed && res.RetryAfter != s.retryAfter) || (s.rule != "" && res.Rule != s.rule) {
				t.Fatalf("step %d at %v, n=%d: got allowed=%v remaining=%d retryAfter=%v rule=%q; want allowed=%v remaining=%d retryAfter=%v rule=%q",
					i, s.at, s.n, res.Allowed, res.Remaining, res.RetryAfter, res.Rule, s.allowed, s.remaining, s.retryAfter, s.rule)
			}
			if s.allowed && res.RetryAfter != 0 {
				t.Fatalf("step %d: allowed with RetryAfter %v, want 0", i, res.RetryAfter)
			}
		}
	})
}

func rule(a Algorithm, l Limit) []Rule { return []Rule{{Name: "r", Algorithm: a, Limit: l}} }

const ms = time.Millisecond

func TestFixedWindowAdmissions(t *testing.T) {
	play(t, rule(FixedWindow, PerSecond(3)), []step{
		{at: 0, n: 1, allowed: true, remaining: 2},
		{at: 0, n: 2, allowed: true, remaining: 0},
		{at: 0, n: 1, allowed: false, remaining: 0, retryAfter: 1000 * ms},
		{at: 999 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 1 * ms},
		{at: 1000 * ms, n: 3, allowed: true, remaining: 0},
		{at: 1500 * ms, n: 2, allowed: false, remaining: 0, retryAfter: 500 * ms},
		{at: 2000 * ms, n: 2, allowed: true, remaining: 1},
	})
}

func TestSlidingLogAdmissions(t *testing.T) {
	play(t, rule(SlidingLog, PerSecond(3)), []step{
		{at: 0, n: 1, allowed: true, remaining: 2},
		{at: 300 * ms, n: 1, allowed: true, remaining: 1},
		{at: 600 * ms, n: 1, allowed: true, remaining: 0},
		// The permit of t=0 leaves at t=1s.
		{at: 900 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 100 * ms},
		// Two permits need the permits of t=0 and t=0.3s gone.
		{at: 900 * ms, n: 2, allowed: false, remaining: 0, retryAfter: 400 * ms},
		{at: 1000 * ms, n: 1, allowed: true, remaining: 0},
		{at: 1000 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 300 * ms},
		{at: 1300 * ms, n: 1, allowed: true, remaining: 0},
	})
}

func TestSlidingWindowAdmissions(t *testing.T) {
	rules := []Rule{{Name: "r", Algorithm: SlidingWindow, Limit: PerSecond(3), Precision: 100 * ms}}
	play(t, rules, []step{
		{at: 0, n: 2, allowed: true, remaining: 1},
		{at: 250 * ms, n: 1, allowed: true, remaining: 0},
		// Bucket [0, 100ms) counts until 100ms + 1s.
		{at: 300 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 800 * ms},
		// Three permits need bucket [200ms, 300ms) gone too: 300ms + 1s.
		{at: 300 * ms, n: 3, allowed: false, remaining: 0, retryAfter: 1000 * ms},
		{at: 1100 * ms, n: 2, allowed: true, remaining: 0},
		{at: 1299 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 1 * ms},
		{at: 1300 * ms, n: 1, allowed: true, remaining: 0},
	})
}

// The token bucket and GCRA are two representations of one rule: they
// admit the same requests at the same instants.
func TestBucketAdmissions(t *testing.T) {
	for _, algo := range []Algorithm{TokenBucket, GCRA} {
		t.Run(string(algo), func(t *testing.T) {
			play(t, rule(algo, PerSecond(10).WithBurst(5)), []step{
				{at: 0, n: 5, allowed: true, remaining: 0},
				{at: 0, n: 1, allowed: false, remaining: 0, retryAfter: 100 * ms},
				{at: 0, n: 3, allowed: false, remaining: 0, retryAfter: 300 * ms},
				{at: 100 * ms, n: 1, allowed: true, remaining: 0},
				{at: 250 * ms, n: 1, allowed: true, remaining: 0},
				// A bucket never holds more than its burst: 5, not 9, after 0.9s.
				{at: 1250 * ms, n: 5, allowed: true, remaining: 0},
				{at: 1250 * ms, n: 1, allowed: false, remaining: 0, retryAfter: 100 * ms},
			})
		})
	}
}

// The fixed window's known flaw: a burst at the end of one window and the
// start of the next admits twice the limit within a few milliseconds. The
// sliding algorithms do not admit it.
func TestWindowBoundaryBurst(t *testing.T) {
	for _, tc := range []struct {
		algo Algorithm
		want int // admitted in [0.99s, 1.01s]
	}{
		{FixedWindow, 10},
		{SlidingLog, 5},
		{SlidingWindow, 5},
	} {
		t.Run(string(tc.algo), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "r", Algorithm: tc.algo, Limit: PerSecond(5), Precision: 10 * ms})
				time.Sleep(990 * ms)
				got := admitted(t, l, "s", 10)
				time.Sleep(20 * ms)
				got += admitted(t, l, "s", 10)
				if got != tc.want {
					t.Fatalf("admitted %d around the window boundary, want %d", got, tc.want)
				}
			})
		})
	}
}

// The policy of issue 2: "1 per second and 5 per minute", sliding logs.
func TestPolicyTwoSlidingLogs(t *testing.T) {
	rules := []Rule{
		{Name: "per-second", Algorithm: SlidingLog, Limit: PerSecond(1)},
		{Name: "per-minute", Algorithm: SlidingLog, Limit: Limit{Count: 5, Period: time.Minute, Burst: 5}},
	}
	s := time.Second
	play(t, rules, []step{
		{at: 0, n: 1, allowed: true, remaining: 0, rule: "per-second"},
		{at: 0, n: 1, allowed: false, remaining: 0, retryAfter: s, rule: "per-second"},
		{at: 1 * s, n: 1, allowed: true, remaining: 0, rule: "per-second"},
		{at: 2 * s, n: 1, allowed: true, remaining: 0},
		{at: 3 * s, n: 1, allowed: true, remaining: 0},
		{at: 4 * s, n: 1, allowed: true, remaining: 0},
		// The permit of t=0 leaves the minute at t=60s.
		{at: 5 * s, n: 1, allowed: false, remaining: 0, retryAfter: 55 * s, rule: "per-minute"},
		{at: 66 * s, n: 1, allowed: true, remaining: 0, rule: "per-second"},
	})
}

// A request denied by one rule of a policy charges no rule, and its delay
// is the longest among the rules that denied.
func TestPolicyDenialChargesNothing(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rules := []Rule{
			{Name: "bucket", Algorithm: TokenBucket, Limit: PerSecond(10)},
			{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10)},
			{Name: "fixed", Algorithm: FixedWindow, Limit: Limit{Count: 4, Period: time.Minute, Burst: 4}},
			{Name: "log", Algorithm: SlidingLog, Limit: Limit{Count: 3, Period: time.Hour, Burst: 3}},
			{Name: "window", Algorithm: SlidingWindow, Limit: Limit{Count: 100, Period: time.Hour, Burst: 100}},
		}
		l := mustNew(t, rdb, Options{Prefix: "p:"}, rules...)
		if res := allow(t, l, "s", 3); !res.Allowed || res.Rule != "log" || res.Remaining != 0 {
			t.Fatalf("first request: %+v, want allowed, log the tightest with 0 left", res)
		}
		dump := func() map[string]string {
			out := map[string]string{}
			for _, r := range rules {
				k := "p:{s}:" + r.Name
				typ, _ := rdb.Type(ctx, k).Result()
				switch typ {
				case "hash":
					v, _ := rdb.HGetAll(ctx, k).Result()
					out[k] = typ + ":" + toString(v)
				case "zset":
					v, _ := rdb.ZRangeWithScores(ctx, k, 0, -1).Result()
					out[k] = typ + ":" + toString(v)
				default:
					v, _ := rdb.Get(ctx, k).Result()
					out[k] = typ + ":" + v
				}
			}
			return out
		}
		before := dump()
		res := allow(t, l, "s", 1)
		if res.Allowed || res.Rule != "log" || res.RetryAfter != time.Hour {
			t.Fatalf("second request: %+v, want denied by log, retry after 1h", res)
		}
		if after := dump(); toString(after) != toString(before) {
			t.Fatalf("a denied request changed state:\nbefore %v\nafter  %v", before, after)
		}
		// fixed (4 per minute, 3 used) and log (3 per hour, 3 used) both
		// deny 2 permits; the log's delay is the longer.
		if res := allow(t, l, "s", 2); res.Allowed || res.Rule != "log" || res.RetryAfter != time.Hour {
			t.Fatalf("n=2: %+v, want denied by log after 1h", res)
		}
	})
}

func toString(v any) string { return fmtAny(v) }

// Every key gets a TTL in milliseconds that covers what it must remember,
// and no more.
func TestKeyTTLs(t *testing.T) {
	for _, tc := range []struct {
		rule Rule
		n    int
		wait time.Duration // before the request
		want time.Duration
	}{
		// Window ends at 1s; the request comes at 0.25s.
		{Rule{Algorithm: FixedWindow, Limit: PerSecond(10)}, 1, 250 * ms, 750 * ms},
		{Rule{Algorithm: SlidingLog, Limit: Limit{Count: 10, Period: time.Minute, Burst: 10}}, 1, 250 * ms, time.Minute},
		// Bucket [200ms, 300ms) counts until 300ms + 1s.
		{Rule{Algorithm: SlidingWindow, Limit: PerSecond(10), Precision: 100 * ms}, 1, 250 * ms, 1050 * ms},
		// 4 tokens of 10 per second take 400ms to refill.
		{Rule{Algorithm: TokenBucket, Limit: PerSecond(10)}, 4, 250 * ms, 400 * ms},
		{Rule{Algorithm: GCRA, Limit: PerSecond(10)}, 4, 250 * ms, 400 * ms},
		// Reserving past the burst: 12 tokens of a 10-burst bucket, 1.2s.
		{Rule{Algorithm: GCRA, Limit: PerSecond(10)}, 10, 0, time.Second},
	} {
		tc.rule.Name = "r"
		t.Run(string(tc.rule.Algorithm), func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, tc.rule)
				time.Sleep(tc.wait)
				allow(t, l, "s", tc.n)
				k := "jobthrottle:{s}:r"
				if got := rdb.PTTL(context.Background(), k).Val(); got != tc.want {
					t.Fatalf("PTTL %s = %v, want %v", k, got, tc.want)
				}
				time.Sleep(tc.want)
				if m.Exists(k) {
					t.Fatalf("%s still exists after its TTL", k)
				}
			})
		})
	}
}

// The token bucket keeps its state in one string (bucket.lua): the time
// the bucket is full again (TAT) and the latest time to act (ev). In
// whole µs: the TAT alone, in decimal, when ev = TAT − T (one permit from
// a full bucket); otherwise 12 bytes: 0xF0 + TAT's top 4 bits, its low 48
// bits, TAT − ev in 5 bytes, big-endian; "<tw> <tr> <ew> <er>" with
// remainders in 1/count µs when an interval is not whole µs. A string it
// cannot read is a full bucket, replaced on the next charge; a key of
// another type (a hash, the format before the first release) fails with
// ErrRedis wrapping WRONGTYPE, as a changed algorithm does.
func TestTokenBucketState(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, rule(TokenBucket, PerSecond(10).WithBurst(5))...)
		k := "jobthrottle:{s}:r"
		allow(t, l, "s", 2)
		// 3 tokens left: full again 2 intervals (200ms) after the call's
		// Redis time, which is also the time to act of the latest permit.
		got, err := rdb.Get(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		us := time.Now().UnixMicro()
		tat, d := us+200_000, int64(200_000)
		want := string([]byte{byte(0xF0 + tat>>48), byte(tat >> 40), byte(tat >> 32), byte(tat >> 24), byte(tat >> 16), byte(tat >> 8), byte(tat),
			byte(d >> 32), byte(d >> 24), byte(d >> 16), byte(d >> 8), byte(d)})
		if got != want {
			t.Fatalf("GET %s = %q, want %q", k, got, want)
		}

		// One permit from a full bucket: the TAT alone, one interval on.
		allow(t, l, "t", 1)
		if got, want := mustGet(m, "jobthrottle:{t}:r"), strconv.FormatInt(us+100_000, 10); got != want {
			t.Fatalf("GET after one permit = %q, want %q", got, want)
		}

		m.Set(k, "not a bucket")
		if res := allow(t, l, "s", 5); !res.Allowed {
			t.Fatalf("a full bucket's burst was denied over an unreadable state: %+v", res)
		}
		if res := allow(t, l, "s", 1); res.Allowed {
			t.Fatal("the replaced state did not keep the burst taken")
		}

		m.Del(k)
		m.HSet(k, "tk", "0", "ts", strconv.FormatInt(us, 10), "ev", "0")
		if _, err := l.Allow(ctx, "s"); !errors.Is(err, ErrRedis) || !strings.Contains(err.Error(), "WRONGTYPE") {
			t.Fatalf("Allow over a hash key = %v; want ErrRedis wrapping WRONGTYPE", err)
		}
	})
}

// use_all.lua hands every algorithm to the scripts for mixed
// policies; one left out would fail only for policies that mix it in.
func TestUseAllListsEveryAlgorithm(t *testing.T) {
	src, err := luaFiles.ReadFile("lua/use_all.lua")
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range registered() {
		for _, f := range []string{"check", "commit"} {
			if want := fmt.Sprintf("%s = %s_%s", a, f, a); !strings.Contains(string(src), want) {
				t.Errorf("use_all.lua lacks %q", want)
			}
		}
	}
}
