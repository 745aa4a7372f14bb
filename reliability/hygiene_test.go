package reliability

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
// past the limit, Wait (admitted and cancelled), Admit (booked, held,
// redeemed), Reserve and Cancel (the
// last, an earlier and a lone reservation; window permits given back by a
// group), Settle up and down, PrepayN and Admit on its receipt, PauseFor. Everything it books lies
// within about 1.5s. It fails the test
// on the first error; exerciseErr returns it instead.
func exercise(t testing.TB, rdb redis.UniversalClient, prefix string) {
	t.Helper()
	if err := exerciseErr(rdb, prefix); err != nil {
		t.Fatal(err)
	}
}

// errReported marks an error that exerciseErr saw only through
// OnRedisError (the library dropped it, as it drops a failed refund).
var errReported = errors.New("reported to OnRedisError")

func exerciseErr(rdb redis.UniversalClient, prefix string) (err error) {
	// Every step below panics with errStep on error; the first one ends the
	// exercise and is returned. Errors that the library drops (a refund's,
	// after a cancelled Wait or a denied group request) still reach
	// OnRedisError, and come first: they are the cause.
	type errStep struct{ err error }
	var mu sync.Mutex
	var dropped []error
	defer func() {
		if r := recover(); r != nil {
			s, ok := r.(errStep)
			if !ok {
				panic(r)
			}
			err = s.err
		}
		mu.Lock()
		defer mu.Unlock()
		switch {
		case len(dropped) > 0 && err != nil:
			err = fmt.Errorf("%w: %w (then: %v)", errReported, dropped[0], err)
		case len(dropped) > 0:
			err = fmt.Errorf("%w: %w", errReported, dropped[0])
		}
	}()
	must := func(err error, what ...any) {
		if err != nil {
			panic(errStep{fmt.Errorf("%s: %w", fmt.Sprint(what...), err)})
		}
	}
	ctx := context.Background()
	newLim := func(rules ...throttle.Rule) *throttle.Limiter {
		l, err := throttle.New(rdb, throttle.Options{Prefix: prefix, OnRedisError: func(err error, _ bool) {
			mu.Lock()
			dropped = append(dropped, err)
			mu.Unlock()
		}}, rules...)
		must(err, "New")
		return l
	}
	for _, rule := range exerciseRules {
		l := newLim(rule)
		for range 5 {
			_, err := l.Allow(ctx, "allow")
			must(err, rule.Name, " Allow")
		}
		wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		must(l.Wait(wctx, "wait"), rule.Name, " Wait")
		must(l.Wait(wctx, "wait"), rule.Name, " Wait")
		cancel()
		// A Wait cancelled while it waits: windows leave their queue,
		// buckets refund.
		for range 5 {
			_, err := l.Allow(ctx, "cancelled")
			must(err, rule.Name, " Allow")
		}
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		if err := l.Wait(cctx, "cancelled"); !errors.Is(err, context.DeadlineExceeded) {
			must(err, rule.Name, " Wait with 50ms deadline")
		}
		cancel()
		_, err := l.PauseFor(ctx, "paused", 300*time.Millisecond)
		must(err, rule.Name, " PauseFor")
		_, err = l.PauseFor(ctx, "paused", 0)
		must(err, rule.Name, " PauseFor(0), the read")
		// Admit: turns granted, then booked ahead under task IDs; one
		// booking redeemed, one held (early), the rest left to lapse.
		// Until one is booked: a window that ends between the calls
		// admits more (on a loaded machine, TLS round trips are slow).
		var booked throttle.Admission
		var bookedID string
		for i := 0; i < 6 || booked.Status != throttle.Booked; i++ {
			if i == 30 {
				must(fmt.Errorf("30 Admits in a row and none booked ahead (last %v)", booked.Status), rule.Name, " Admit")
			}
			bookedID = fmt.Sprint("task-", i)
			a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "admit", N: 1, Caller: throttle.Caller{ID: bookedID}, Wait: 0, Tolerance: 100 * time.Millisecond})
			must(err, rule.Name, " Admit")
			booked = a
		}
		for _, wait := range []time.Duration{0, -1} {
			// A window's booked turn is at the next window's start, which
			// may be a few ms away: only a turn still well ahead must be
			// Held.
			ahead := time.Until(booked.At) > 100*time.Millisecond
			a, err := l.Admit(ctx, throttle.AdmitRequest{Subject: "admit", N: 1, Caller: throttle.Caller{ID: bookedID}, Wait: wait, Tolerance: 100 * time.Millisecond})
			must(err, rule.Name, " Admit again")
			want := map[time.Duration]throttle.AdmitStatus{0: throttle.Held, -1: throttle.Redeemed}[wait]
			if a.Status != want && (ahead || a.Status != throttle.Redeemed) {
				must(fmt.Errorf("status %v, want %v", a.Status, want), rule.Name, " Admit a booked task")
			}
		}
		// The state read, AllowAtMost and Reset (issue 11).
		_, err = l.AllowN(ctx, "allow", 0)
		must(err, rule.Name, " AllowN(0)")
		_, _, err = l.AllowAtMost(ctx, "atmost", 3)
		must(err, rule.Name, " AllowAtMost")
		must(l.Reset(ctx, "atmost"), rule.Name, " Reset")
		if rule.Algorithm != throttle.TokenBucket && rule.Algorithm != throttle.GCRA {
			continue
		}
		var rs []*throttle.Reservation
		for range 5 {
			r, err := l.ReserveN(ctx, "reserve", 1)
			must(err, rule.Name, " Reserve")
			rs = append(rs, r)
		}
		must(rs[2].Cancel(ctx), rule.Name, " Cancel an earlier reservation") // recorded as cancelled
		must(rs[4].Cancel(ctx), rule.Name, " Cancel the last reservation")
		p, err := l.PrepayN(ctx, "prepaid", 1, 500*time.Millisecond)
		must(err, rule.Name, " PrepayN")
		receipt, _ := p.Receipt()
		_, err = l.Admit(ctx, throttle.AdmitRequest{Subject: "prepaid", N: 1, Caller: throttle.Caller{Receipt: receipt}, Wait: -1})
		must(err, rule.Name, " Admit on a receipt")
		p2, err := l.PrepayN(ctx, "prepaid", 1, 500*time.Millisecond)
		must(err, rule.Name, " PrepayN")
		must(p2.Cancel(ctx), rule.Name, " Cancel a prepaid reservation")
	}
	// Settles, up and down, of every algorithm: a reservation, and a turn
	// booked by Admit and redeemed (its tickets kept in Redis).
	for _, rule := range exerciseRules {
		l := newLim(rule)
		r, err := l.ReserveN(ctx, "settled", 2)
		must(err, rule.Name, " Reserve to settle")
		must(r.Settle(ctx, 1), rule.Name, " Settle down")
		r, err = l.ReserveN(ctx, "settled", 1)
		must(err, rule.Name, " Reserve to settle")
		must(r.Settle(ctx, 2), rule.Name, " Settle up")
	}
	// Refunds of every kind: a lone reservation given back, and window permits given back when a later part of
	// a group denies.
	for _, rule := range exerciseRules[3:] {
		r, err := newLim(rule).ReserveN(ctx, "lone", 1)
		must(err, rule.Name, " Reserve")
		must(r.Cancel(ctx), rule.Name, " Cancel a lone reservation")
	}
	for _, w := range exerciseRules[:3] {
		subject := "refunded-" + w.Name
		one := throttle.Rule{Name: "one", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Second, Burst: 1}}
		full := newLim(one)
		one.Subject = subject // the same subject, as a second part: acquired after w's
		g := newLim(w, one)
		_, err := full.Allow(ctx, subject) // "one" has no permit left
		must(err, "Allow")
		res, err := g.Allow(ctx, subject) // w admits, "one" denies: w's permit comes back
		must(err, w.Name, " group Allow")
		if res.Allowed {
			must(errors.New("allowed"), w.Name, " group Allow past its limit")
		}
		// A failed refund is dropped by the group (it reports it only to
		// OnRedisError), so check that it happened.
		res, err = newLim(w).Allow(ctx, subject)
		must(err, w.Name, " Allow")
		if want := w.Limit.Count - 1; res.Remaining != want {
			must(fmt.Errorf("Remaining %d, want %d: the denied group request kept its permit", res.Remaining, want), w.Name, " refund")
		}
	}
	policy := newLim(
		throttle.Rule{Name: "per-second", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)},
		throttle.Rule{Name: "per-window", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 20, Period: time.Second}},
		throttle.Rule{Name: "sliding", Algorithm: throttle.SlidingWindow, Limit: throttle.Limit{Count: 30, Period: time.Second}},
	)
	for range 12 {
		_, err := policy.Allow(ctx, "tenant-1")
		must(err, "policy Allow")
	}
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	must(policy.Wait(wctx, "tenant-2"), "policy Wait")
	cancel()
	global := exerciseRules[4]
	global.Subject = "global"
	g := newLim(global, exerciseRules[0])
	for range 5 {
		_, err := g.Allow(ctx, "tenant-3")
		must(err, "group Allow")
	}
	wctx, cancel = context.WithTimeout(ctx, 3*time.Second)
	must(g.Wait(wctx, "tenant-4"), "group Wait")
	cancel()
	return nil
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
