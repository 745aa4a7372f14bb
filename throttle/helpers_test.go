package throttle

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
)

// virtual runs f in a testing/synctest bubble with a miniredis inside it:
// Redis TIME, key expiry and the limiter's timers share one fake clock,
// which starts at 2000-01-01T00:00:00Z (see redistest.Virtual).
func virtual(t *testing.T, f func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis)) {
	t.Helper()
	redistest.Virtual(t, f)
}

// countScripts counts the script commands (EVALSHA and EVAL) rdb sends:
// the round trips of decisions.
func countScripts(rdb redis.UniversalClient) *redistest.ScriptCalls {
	return redistest.CountScripts(rdb)
}

// mustNew builds a limiter or fails the test.
func mustNew(t testing.TB, rdb redis.UniversalClient, opts Options, rules ...Rule) *Limiter {
	t.Helper()
	l, err := New(rdb, opts, rules...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = l.Close() }) // no goroutine outlives its test
	return l
}

// allow calls AllowN and fails the test on error.
func allow(t testing.TB, l *Limiter, subject string, n int) Result {
	t.Helper()
	res, err := l.AllowN(context.Background(), subject, n)
	if err != nil {
		t.Fatalf("AllowN(%q, %d): %v", subject, n, err)
	}
	return res
}

// admitted counts how many of k single-permit Allow calls succeed.
func admitted(t testing.TB, l *Limiter, subject string, k int) int {
	t.Helper()
	got := 0
	for range k {
		if allow(t, l, subject, 1).Allowed {
			got++
		}
	}
	return got
}

// warm loads the limiter's script so that later calls are one EVALSHA each.
func warm(t testing.TB, l *Limiter) {
	t.Helper()
	if _, err := l.Allow(context.Background(), "warm-up"); err != nil {
		t.Fatalf("warm-up: %v", err)
	}
}

var epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// at returns the bubble's clock offset from its start.
func at() time.Duration { return time.Since(epoch) }

// fmtAny renders maps and slices deterministically (fmt sorts map keys).
func fmtAny(v any) string { return fmt.Sprint(v) }

func formatInt(n int) string { return fmt.Sprint(n) }

// receiptOf returns a prepaid reservation's receipt id.
func receiptOf(r *Reservation) string {
	id, _ := r.Receipt()
	return id
}

// redeem claims a receipt from PrepayN, as a consumer does through Admit,
// without charging anything when the receipt proves nothing: it looks the
// receipt up first, and admits only one that is there. It reports the
// delay until the receipt's slot and whether it was redeemed.
func redeem(ctx context.Context, l *Limiter, subject, receipt string) (time.Duration, bool, error) {
	if _, err := encodeSubject(subject); err != nil {
		return 0, false, err
	}
	if receipt == "" || len(receipt) > maxReceiptLen {
		return 0, false, nil
	}
	if err := l.rdb.ZScore(ctx, l.receiptsKey(subject), l.member(receipt)).Err(); err == redis.Nil {
		return 0, false, nil
	} else if err != nil {
		return 0, false, err
	}
	a, err := l.Admit(ctx, AdmitRequest{Subject: subject, N: 1, Caller: Caller{Receipt: receipt}, Wait: -1, Tolerance: 24 * time.Hour})
	return a.Delay, a.Status == Redeemed, err
}

// delayBy reports whether err is a *DelayError whose bound was the
// context's deadline (deadline) or the limiter's MaxWait (!deadline).
func delayBy(err error, deadline bool) bool {
	var de *DelayError
	return errors.As(err, &de) && de.Deadline == deadline
}

// rateAlgorithms returns the registered algorithms that count permits per
// period: all but Concurrency, which counts holders (concurrency_test.go
// tests it), and CalendarWindow, whose windows are the calendar's
// (calendar_test.go tests it).
func rateAlgorithms() []Algorithm {
	var as []Algorithm
	for _, a := range registered() {
		if !a.spec().holders && a != CalendarWindow {
			as = append(as, a)
		}
	}
	return as
}

// placesOf returns the places of l's Concurrency rule (its mode).
func placesOf(l *Limiter) *leases { return l.mode.(*leases) }

// leaserOf returns l's leaser (its mode, Options.LocalLease).
func leaserOf(l *Limiter) *leaser { return l.mode.(*leaser) }

// takeLease makes q take one lease of n turns of subject, and returns it.
func takeLease(t *testing.T, q *leaser, subject string, n int) *lease {
	t.Helper()
	k := q.lock(subject)
	k.mu.Unlock()
	q.call(context.Background(), subject, k, n, time.Now())
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.leases) != 1 || k.leases[0].k != n {
		t.Fatalf("leases %+v, want one of %d turns", k.leases, n)
	}
	return k.leases[0]
}

// sampleRule is a rule named name of algorithm a under lim; a
// CalendarWindow rule counts lim.Count a day (UTC) instead of per period.
func sampleRule(name string, a Algorithm, lim Limit) Rule {
	r := Rule{Name: name, Algorithm: a, Limit: lim}
	if a == CalendarWindow {
		r.Limit.Period, r.Calendar = 0, Daily(nil)
	}
	return r
}
