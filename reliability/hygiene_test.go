package reliability

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// exerciseRules are short-horizon rules of every algorithm, so that the
// keys they leave expire within a second or two on a real server.
var exerciseRules = []throttle.Rule{
	{Name: "fixed", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 3, Period: time.Second}},
	{Name: "log", Algorithm: throttle.SlidingLog, Limit: throttle.Limit{Count: 3, Period: time.Second}},
	{Name: "window", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 3, Period: time.Second}, Precision: 100 * time.Millisecond},
	{Name: "bucket", Algorithm: throttle.TokenBucket, Limit: throttle.PerSecond(10).WithBurst(2)},
	{Name: "gcra", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(2)},
}

// exercise drives every operation of the library that touches Redis, on
// every algorithm, a three-rule policy and a group, under prefix: Allow
// past the limit, Wait (admitted and cancelled), Reserve and Cancel (the
// last and an earlier reservation), PrepayN and Redeem, PauseFor and
// Paused. Everything it books lies within about 1.5s.
func exercise(t *testing.T, rdb redis.UniversalClient, prefix string) {
	t.Helper()
	ctx := context.Background()
	newLim := func(rules ...throttle.Rule) *throttle.Limiter {
		t.Helper()
		l, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rules...)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, rule := range exerciseRules {
		l := newLim(rule)
		for range 5 {
			_, err := l.Allow(ctx, "allow")
			must(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		must(l.Wait(wctx, "wait"))
		must(l.Wait(wctx, "wait"))
		cancel()
		// A Wait cancelled while it waits: windows leave their queue,
		// buckets refund.
		for range 5 {
			_, _ = l.Allow(ctx, "cancelled")
		}
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		if err := l.Wait(cctx, "cancelled"); !errors.Is(err, context.DeadlineExceeded) && err != nil {
			t.Fatalf("%v: Wait with 50ms deadline: %v", rule, err)
		}
		cancel()
		must(l.PauseFor(ctx, "paused", 300*time.Millisecond))
		_, err := l.Paused(ctx, "paused")
		must(err)
		if rule.Algorithm != throttle.TokenBucket && rule.Algorithm != throttle.GCRA {
			continue
		}
		var rs []*throttle.Reservation
		for range 5 {
			r, err := l.Reserve(ctx, "reserve")
			must(err)
			rs = append(rs, r)
		}
		must(rs[2].Cancel(ctx)) // an earlier one: recorded as cancelled
		must(rs[4].Cancel(ctx)) // the last
		p, err := l.PrepayN(ctx, "prepaid", 1, 500*time.Millisecond)
		must(err)
		_, _, err = l.Redeem(ctx, "prepaid", p.Receipt())
		must(err)
		p2, err := l.PrepayN(ctx, "prepaid", 1, 500*time.Millisecond)
		must(err)
		must(p2.Cancel(ctx))
	}
	policy := newLim(
		throttle.Rule{Name: "per-second", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
		throttle.Rule{Name: "per-window", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 20, Period: time.Second}},
		throttle.Rule{Name: "sliding", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 30, Period: time.Second}},
	)
	for range 12 {
		_, err := policy.Allow(ctx, "tenant-1")
		must(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	must(policy.Wait(wctx, "tenant-2"))
	cancel()
	g, err := throttle.NewGroup(
		throttle.Part{Limiter: newLim(exerciseRules[4]), Subject: throttle.Fixed("global")},
		throttle.Part{Limiter: newLim(exerciseRules[0])},
	)
	must(err)
	for range 5 {
		_, err := g.Allow(ctx, "tenant-3")
		must(err)
	}
	wctx, cancel = context.WithTimeout(ctx, 3*time.Second)
	must(g.Wait(wctx, "tenant-4"))
	cancel()
}

// TestKeyHygiene runs every operation of the library on every backend
// (miniredis, and in CI the shared Redis and Redis Cluster) and checks the
// key contract with assertKeyHygiene: every key jobthrottle leaves has a
// TTL, and the prefix is empty once the longest TTL has passed.
func TestKeyHygiene(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			prefix := redistest.Prefix(t)
			exercise(t, b.Client, prefix)
			n := len(scanKeys(t, b.Client, prefix))
			longest := assertKeyHygiene(t, b.Client, prefix, b.Mini)
			t.Logf("%d keys, longest TTL %v, all expired after it", n, longest)
		})
	}
}
