package admission

import (
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestStackForgets: a stack learns that a tenant binds, and forgets it
// once the tenant no longer does. Phase 1: 300 jobs over three keys of
// 10/s within a tenant of 15/s (the tenant binds): the jobs of each key
// and the tenant come to be held to meet. Phase 2, on the same stack:
// 300 jobs of one key still held after phase 1, alone (10/s within
// 15/s: the key binds): the key's jobs find
// the tenant not binding, and within forgetMisses held jobs in a row
// (plus the jobs the 8 workers admitted meanwhile) go back to the key's
// line, so the phase costs about what the key's line alone does (3.3
// limiter calls a job) instead of held turns' 6-9. Both phases hold
// every limit in every second on the Redis clock and run each job once.
func TestStackForgets(t *testing.T) {
	const keys, n = 3, 300
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ledger := redistest.PipeClient(m)
		defer ledger.Close()
		oneKey := -1
		subsOf := func(id string) []string {
			i, _ := strconv.Atoi(id[len("job-"):])
			if oneKey >= 0 {
				i = oneKey
			}
			return []string{fmt.Sprintf("key-%d", i%keys), "acme"}
		}
		b, p := newStackBed(t, rdb, ledger, n, subsOf,
			throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)},
			throttle.Rule{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(15).WithBurst(1)})
		heldKey := func(k int) bool {
			return b.stack.leads.has(leadsKey([]Request{{Subject: fmt.Sprintf("key-%d", k)}, {Subject: "acme"}}))
		}
		// The most held at once, sampled at every admission: at the end
		// the key that drains last runs alone, at its own limit, and may
		// rightly be forgotten already (2 runs in 80 on virtual time).
		var mu sync.Mutex
		admitted, heldMost := 0, 0
		b.after = func() {
			mu.Lock()
			defer mu.Unlock()
			h := 0
			for k := range keys {
				if heldKey(k) {
					h++
				}
			}
			heldMost = max(heldMost, h)
		}
		took := b.run(p, n*time.Second/15)
		calls1 := float64(b.calls.Load()) / n
		t.Logf("phase 1 (the tenant binds): %d jobs in %v, %.3f limiter calls a job; at most %d of %d subject pairs held at once, %d at the end",
			n, took, calls1, heldMost, keys, b.stack.leads.len())
		if heldMost != keys {
			t.Fatalf("in phase 1, at most %d of %d keys' jobs were held to meet the tenant's turns at once: the stack did not learn that the tenant binds", heldMost, keys)
		}
		// Phase 2 runs on a key still held.
		for k := range keys {
			if heldKey(k) {
				oneKey = k
				break
			}
		}
		if oneKey < 0 {
			t.Fatal("after phase 1, no key's jobs are held to meet the tenant's turns")
		}
		held := func() bool { return heldKey(oneKey) }

		// Phase 2: one key only.
		mu.Lock()
		admitted = 0
		mu.Unlock()
		forgotAfter, forgotAt := -1, time.Duration(0)
		start := time.Now()
		b.after = func() {
			mu.Lock()
			defer mu.Unlock()
			if admitted++; forgotAfter < 0 && !held() {
				forgotAfter, forgotAt = admitted, time.Since(start)
			}
		}
		b.mu.Lock()
		b.first, b.ran, b.ranAll, b.bySub, b.starts = n, map[string]int{}, make(chan struct{}), map[string][]time.Time{}, make([][]time.Time, 2)
		b.mu.Unlock()
		before := b.calls.Load()
		took = b.run(p, n*time.Second/10)
		calls2 := float64(b.calls.Load()-before) / n
		t.Logf("phase 2 (the key binds): %d jobs in %v, %.3f limiter calls a job; the tenant forgotten after %d admissions, %v",
			n, took, calls2, forgotAfter, forgotAt)

		if forgotAfter < 0 {
			t.Fatal("phase 2: key-0's jobs are still held to meet the tenant's turns, though the key binds")
		}
		// Forgotten after 10-14 admissions in most runs, 20-22 in about
		// a third (40 runs on virtual time, 2026-11-26, the same on the
		// code before that day's merges: CI failed it at 21 against the
		// old bound of one probe period): the 8 workers' admissions
		// interleave differently, and then one more probe period passes
		// before the misses are counted in a row (not broken down).
		// Held for good, the defect this test is for, fails above.
		if most := 2*probeEvery + forgetMisses + 8; forgotAfter > most {
			t.Errorf("the tenant forgotten after %d admissions, want at most %d", forgotAfter, most)
		}
		if forgotAt > 2*time.Second {
			t.Errorf("the tenant forgotten after %v, want within 2s", forgotAt)
		}
		if calls2 > 3.6 {
			t.Errorf("phase 2: %.3f limiter calls a job, want at most 3.6 (the key's line)", calls2)
		}
		if want := time.Duration(n-1) * time.Second / 10; took > want+2*time.Second {
			t.Errorf("phase 2 took %v, want about %v (the key's limit)", took, want)
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		for i, most := range []int{11, 16} {
			if got := redistest.MaxInWindow(b.starts[i], time.Second); got > most {
				t.Errorf("phase 2, gate %d: %d turns in one second on the Redis clock, want at most %d", i, got, most)
			}
		}
	})
}

// TestLeadMemory: the memory of binding gates has every probeEvery-th
// job probe (each one after a miss), forgets a tuple after forgetMisses
// probes in a row that it did not bind (a bound job starts
// the count again), after forgetIdle without binding, and the least
// recently used tuple when full; a tuple whose subject under a gate that
// gate binds in another tuple is learnt at its first job, unless its own
// probes forgot it.
func TestLeadMemory(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	t.Run("misses", func(t *testing.T) {
		l := newLeadMemory(4)
		l.learn("a", 1, binderKey(1, "a"), t0)
		for i := range forgetMisses - 1 {
			if l.observe("a", false, t0) {
				t.Fatalf("forgotten after %d misses, want %d", i+1, forgetMisses)
			}
		}
		l.observe("a", true, t0) // binds again: the count starts over
		for i := range forgetMisses {
			forgot := l.observe("a", false, t0)
			if want := i == forgetMisses-1; forgot != want {
				t.Fatalf("miss %d: forgot %v, want %v", i+1, forgot, want)
			}
		}
		if _, _, ok := l.lookup("a", nil, t0); ok {
			t.Error("a forgotten tuple is still held")
		}
	})
	t.Run("probes", func(t *testing.T) {
		l := newLeadMemory(4)
		l.learn("a", 1, binderKey(1, "a"), t0)
		for i := 1; i <= 2*probeEvery; i++ {
			_, probe, _ := l.lookup("a", nil, t0)
			if want := i%probeEvery == 0; probe != want {
				t.Errorf("job %d: probe %v, want %v", i, probe, want)
			}
		}
		l.observe("a", false, t0) // one probe found it not binding: each job probes
		for i := range 2 {
			if _, probe, _ := l.lookup("a", nil, t0); !probe {
				t.Errorf("job %d after a miss: no probe", i+1)
			}
		}
	})
	t.Run("idle", func(t *testing.T) {
		l := newLeadMemory(4)
		l.learn("a", 1, binderKey(1, "a"), t0)
		if g, _, ok := l.lookup("a", nil, t0.Add(forgetIdle)); !ok || g != 1 {
			t.Errorf("at forgetIdle: got %d, %v, want 1, true", g, ok)
		}
		if _, _, ok := l.lookup("a", nil, t0.Add(forgetIdle+time.Millisecond)); ok {
			t.Error("past forgetIdle without binding: still held")
		}
		if got := l.len(); got != 0 {
			t.Errorf("%d tuples held, want 0", got)
		}
	})
	t.Run("binders", func(t *testing.T) {
		l := newLeadMemory(4)
		acme, other := binderKey(1, "acme"), binderKey(1, "other")
		l.learn("key-1/acme", 1, acme, t0)
		if _, _, ok := l.lookup("key-0/other", func() []string { return []string{binderKey(0, "key-0"), other} }, t0); ok {
			t.Error("a tuple of another tenant learnt from key-1's")
		}
		binders := func() []string { return []string{binderKey(0, "key-0"), acme} }
		if g, probe, ok := l.lookup("key-0/acme", binders, t0); !ok || g != 1 || probe {
			t.Fatalf("key-0/acme: got %d, probe %v, %v; want gate 1 learnt from key-1/acme, no probe", g, probe, ok)
		}
		for range forgetMisses {
			l.observe("key-0/acme", false, t0)
		}
		if _, _, ok := l.lookup("key-0/acme", binders, t0.Add(time.Second)); ok {
			t.Error("key-0/acme, forgotten by its probes, learnt again from key-1/acme")
		}
		if !l.has("key-1/acme") || l.has("key-0/acme") {
			t.Errorf("held: key-1/acme %v, key-0/acme %v; want true, false", l.has("key-1/acme"), l.has("key-0/acme"))
		}
		// forgetIdle after: key-1/acme bound at t0, too long ago to teach.
		late := t0.Add(forgetIdle + time.Millisecond)
		if _, _, ok := l.lookup("key-2/acme", func() []string { return []string{acme} }, late); ok {
			t.Error("key-2/acme learnt from a binder idle past forgetIdle")
		}
		l.observe("key-1/acme", true, late) // key-1's probe finds the tenant binding
		if _, _, ok := l.lookup("key-2/acme", func() []string { return []string{acme} }, late); !ok {
			t.Error("key-2/acme not learnt from key-1/acme, which just bound")
		}
		if got := l.len(); got != 2 {
			t.Errorf("%d tuples held, want 2 (key-1 and key-2)", got)
		}
	})
	t.Run("lru", func(t *testing.T) {
		l := newLeadMemory(2)
		l.learn("a", 1, binderKey(1, "a"), t0)
		l.learn("b", 1, binderKey(1, "b"), t0)
		l.lookup("a", nil, t0) // a used last: b goes first
		l.learn("c", 1, binderKey(1, "c"), t0)
		for k, want := range map[string]bool{"a": true, "b": false, "c": true} {
			if _, _, ok := l.lookup(k, nil, t0); ok != want {
				t.Errorf("%s held: %v, want %v", k, ok, want)
			}
		}
		if got := l.len(); got != 2 {
			t.Errorf("%d tuples held, want 2", got)
		}
	})
}
