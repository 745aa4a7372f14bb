package throttle

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// nestRules are a per-key rule (2/s) and its tenant's (3/s): the tenant
// binds when three keys have work.
func nestRules() []Rule {
	return []Rule{
		{Name: "key", Algorithm: GCRA, Limit: PerSecond(2).WithBurst(1)},
		{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(3).WithBurst(1), Outer: true},
	}
}

// A nested subject's keys are under the outer subject's hash tag, and an
// Outer rule's key is the one a limiter called with the outer subject
// keeps: a tenant's tasks of a key and its tenant-wide tasks share its
// limit.
func TestNestKeys(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{Prefix: "p:"}, nestRules()...)
		tenant := mustNew(t, rdb, Options{Prefix: "p:"}, Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(3).WithBurst(1)})
		if res := allow(t, l, Nest("t 1", "k/1"), 1); !res.Allowed {
			t.Fatalf("first request of a nested subject: %+v", res)
		}
		keys := m.Keys()
		for _, want := range []string{"p:{t%201}{k/1}:key", "p:{t%201}:tenant"} {
			if !slices.Contains(keys, want) {
				t.Errorf("keys %q: no %q", keys, want)
			}
		}
		// The tenant's one permit is taken: the tenant-wide limiter sees it.
		if res := allow(t, tenant, "t 1", 1); res.Allowed {
			t.Errorf("the tenant-wide limiter after a nested request took the tenant's only permit: %+v, want denied", res)
		}
		// A subject that is not nested is limited by the Outer rule as by any.
		if res := allow(t, l, "other", 1); !res.Allowed {
			t.Errorf("a plain subject: %+v", res)
		}
		if !slices.Contains(m.Keys(), "p:{other}:tenant") {
			t.Errorf("keys %q: no p:{other}:tenant", m.Keys())
		}
	})
}

// Bad nested subjects and Outer rules are refused with errors that say why.
func TestNestInvalid(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, nestRules()...)
		for _, s := range []string{Nest("", "k"), Nest("t", ""), Nest("t", Nest("k", "x"))} {
			if _, err := l.Allow(context.Background(), s); !errors.Is(err, ErrInvalidSubject) {
				t.Errorf("Allow(%q): %v, want ErrInvalidSubject", s, err)
			}
		}
		_, err := New(rdb, Options{}, Rule{Name: "g", Algorithm: GCRA, Limit: PerSecond(1), Outer: true, Subject: "all"})
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != "outer" {
			t.Errorf("an Outer rule over its own Subject: %v, want a ConfigError on outer", err)
		}
	})
}

// Three keys of one tenant, each with a backlog, book their turns through
// Admit: every turn is under both limits at once, so the tenant's turns are
// its interval apart with none lost, and no key goes past its own.
func TestNestAdmitBacklog(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, nestRules()...)
		calls := countScripts(rdb)
		const perKey = 20
		var all []time.Duration
		byKey := map[string][]time.Duration{}
		for i := range perKey {
			for _, k := range []string{"a", "b", "c"} {
				id := fmt.Sprintf("%s-%02d", k, i)
				a, err := l.Admit(ctx, AdmitRequest{Subject: Nest("t", k), N: 1, Caller: Caller{ID: id}, Wait: 0, Tolerance: 10 * ms})
				if err != nil || (a.Status != Granted && a.Status != Booked) {
					t.Fatalf("Admit %s: %+v, %v", id, a, err)
				}
				all = append(all, a.Delay)
				byKey[k] = append(byKey[k], a.Delay)
			}
		}
		if got, want := calls.Load(), int64(3*perKey); got != want {
			t.Errorf("%d admits sent %d script calls, want one each", want, got)
		}
		slices.Sort(all)
		interval := time.Second / 3
		for i, d := range all {
			if want := time.Duration(i) * interval; d < want-ms || d > want+ms {
				t.Fatalf("turn %d of the tenant at %v, want %v (its interval apart, none lost): %v", i, d, want, all)
			}
		}
		for k, ds := range byKey {
			for i := 1; i < len(ds); i++ {
				if gap := ds[i] - ds[i-1]; gap < time.Second/2-ms {
					t.Errorf("key %s: turns %v and %v, %v apart, under its 2/s", k, ds[i-1], ds[i], gap)
				}
			}
		}
	})
}

// Reset of a nested subject forgets its key's state, not its tenant's.
func TestNestReset(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "key", Algorithm: FixedWindow, Limit: Limit{Count: 1, Period: time.Hour, Burst: 1}},
			Rule{Name: "tenant", Algorithm: FixedWindow, Limit: Limit{Count: 2, Period: time.Hour, Burst: 2}, Outer: true})
		for _, k := range []string{"a", "b"} {
			if res := allow(t, l, Nest("t", k), 1); !res.Allowed {
				t.Fatalf("key %s: %+v", k, res)
			}
		}
		if err := l.Reset(ctx, Nest("t", "a")); err != nil {
			t.Fatal(err)
		}
		if !m.Exists(DefaultPrefix + "{t}:tenant") {
			t.Errorf("Reset of a nested subject deleted its tenant's state")
		}
		res := allow(t, l, Nest("t", "a"), 1)
		if res.Allowed || res.Rule != "tenant" {
			t.Errorf("key a after its Reset, its tenant's 2 permits taken: %+v, want denied by the tenant", res)
		}
	})
}

// A turn is charged to every rule at the time it acts. Key a's backlog
// is held back by its own limit (2/s), not its tenant's (3/s); key b's
// turns, after a's, come the tenant's interval after the last of a's,
// then b's own interval apart (before, the tenant was charged at its own
// earliest times, 0, 333 and 667 ms, while a's turns acted at 0, 500 and
// 1000 ms, and b's first turn took 1000 ms again).
func TestNestTurnChargedWhenItActs(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, nestRules()...)
		var turns []time.Duration
		for _, k := range []string{"a", "a", "a", "b", "b", "b"} {
			a, err := l.Admit(ctx, AdmitRequest{Subject: Nest("t", k), N: 1, Caller: Caller{ID: fmt.Sprint(k, len(turns))}, Wait: 0, Tolerance: 10 * ms})
			if err != nil {
				t.Fatal(err)
			}
			turns = append(turns, a.Delay)
		}
		want := []time.Duration{0, 500 * ms, time.Second, 1333333 * time.Microsecond, 1833333 * time.Microsecond, 2333333 * time.Microsecond}
		for i := range want {
			if d := turns[i] - want[i]; d < -ms || d > ms {
				t.Fatalf("turns %v, want %v: the tenant's turns its interval apart when they act", turns, want)
			}
		}
	})
}
