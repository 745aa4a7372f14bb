package admission

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestSettingsCheck: every field out of range is refused with its name, as
// the rules file spells it, and a share limit a limiter's rules cannot
// keep unwraps to throttle's *ConfigError.
func TestSettingsCheck(t *testing.T) {
	window := throttle.Rule{Name: "w", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(100)}
	gcra := throttle.Rule{Name: "g", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)}
	for _, tc := range []struct {
		name  string
		s     Settings
		rules []throttle.Rule
		field string // "" if valid
	}{
		{"zero", Settings{}, nil, ""},
		{"all set", Settings{MaxWait: time.Second, WaitSlots: 3, Horizon: MaxHorizon, Weights: map[string]int{"a": 1, "b": MaxWeight}, ShareLimit: throttle.PerSecond(10)}, []throttle.Rule{gcra}, ""},
		{"no line", Settings{Horizon: -1}, nil, ""},
		{"negative max wait", Settings{MaxWait: -1}, nil, "max_wait"},
		{"negative wait slots", Settings{WaitSlots: -1}, nil, "wait_slots"},
		{"horizon past a day", Settings{Horizon: MaxHorizon + 1}, nil, "horizon"},
		{"weight zero", Settings{Weights: map[string]int{"a": 0}}, nil, "weights"},
		{"weight too large", Settings{Weights: map[string]int{"a": MaxWeight + 1}}, nil, "weights"},
		{"share limit without period", Settings{ShareLimit: throttle.Limit{Count: 1}}, nil, "share_limit"},
		{"share limit over a window", Settings{ShareLimit: throttle.PerSecond(10)}, []throttle.Rule{window}, "share_limit"},
		{"max age", Settings{MaxAge: time.Minute}, nil, ""},
		{"negative max age", Settings{MaxAge: -1}, nil, "priority"},
		{"max age with a share limit", Settings{MaxAge: time.Minute, ShareLimit: throttle.PerSecond(10)}, []throttle.Rule{gcra}, "priority"},
	} {
		err := tc.s.Check(tc.rules...)
		var se *SettingsError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: got %v, want nil", tc.name, err)
		case tc.field != "" && !errors.As(err, &se):
			t.Errorf("%s: got %v, want a *SettingsError", tc.name, err)
		case tc.field != "" && se.Field != tc.field:
			t.Errorf("%s: got field %q, want %q (%v)", tc.name, se.Field, tc.field, err)
		}
	}
	err := Settings{ShareLimit: throttle.PerSecond(10)}.Check(window)
	if ce := (*throttle.ConfigError)(nil); !errors.As(err, &ce) || ce.Rule != "w" {
		t.Errorf("got %v, want it to unwrap to throttle's error for rule %q", err, "w")
	}
}

// TestGateWeighsShares: a gate gives each job in line its share's weight
// from Settings.Weights, unless the request names one: with gold weighed
// 3 and plain 1, the first eight turns the line hands out go 6 to gold, 2
// to plain; a request's own weight of 1 puts gold back at 1 for 1.
func TestGateWeighsShares(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		key := throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)}
		for _, tc := range []struct {
			subject    string
			goldWeight int // the request's own; 0: Settings.Weights'
			wantGold   int
		}{{"weighed", 0, 6}, {"own weight", 1, 4}} {
			g := newGate(t, rdb, Options{Settings: Settings{MaxWait: time.Microsecond, Horizon: 100 * time.Millisecond, Weights: map[string]int{"gold": 3}}}, key)
			ctx := context.Background()
			if d, err := g.Admit(ctx, Request{Subject: tc.subject, Caller: throttle.Caller{ID: "first"}}); err != nil || d.Outcome != Run {
				t.Fatalf("%s: first job: %+v, %v; want run", tc.subject, d, err)
			}
			// No job waits in place; past the horizon's turn or two,
			// they wait in line, and the servings order them.
			for i := range 8 {
				for _, share := range []string{"gold", "plain"} {
					c := throttle.Caller{ID: fmt.Sprintf("%s%d", share, i), Share: share}
					if share == "gold" {
						c.Weight = tc.goldWeight
					}
					if _, err := g.Admit(ctx, Request{Subject: tc.subject, Caller: c}); err != nil {
						t.Fatal(err)
					}
				}
			}
			names := serveFor(t, g, tc.subject, 8)
			gold := 0
			for _, n := range names[:min(8, len(names))] {
				if strings.HasPrefix(n, "gold") {
					gold++
				}
			}
			if len(names) < 8 || gold != tc.wantGold {
				t.Errorf("%s: the first 8 turns handed (%v): %d to gold; want %d", tc.subject, names, gold, tc.wantGold)
			}
		}
	})
}

// TestGatePriority: a gate passes a job's priority and Settings.MaxAge to
// its subject's line: three low jobs wait in line, then two high ones join
// and are handed the first turns; then, with a 1s MaxAge, a low job that
// has waited past it is handed its turn before a high one that joined
// after it.
func TestGatePriority(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		key := throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)}
		g := newGate(t, rdb, Options{Settings: Settings{MaxWait: time.Microsecond, Horizon: 100 * time.Millisecond, MaxAge: time.Second}}, key)
		ctx := context.Background()
		admit := func(id string, prio int) {
			t.Helper()
			if _, err := g.Admit(ctx, Request{Subject: "acct", Caller: throttle.Caller{ID: id, Priority: prio}}); err != nil {
				t.Fatal(err)
			}
		}
		serve := func(n int) []string { return serveFor(t, g, "acct", n)[:n] }
		admit("first", 0)
		for _, id := range []string{"low0", "low1", "low2", "low3"} {
			admit(id, 0)
		}
		admit("high0", 3)
		admit("high1", 3)
		if got := serve(2); !slices.Equal(got, []string{"high0", "high1"}) {
			t.Errorf("first turns handed: %v; want high0, high1", got)
		}
		// low1 .. low3 pass their age bound (low0's turn was booked at
		// once, within the horizon: it never joined the line).
		time.Sleep(time.Second)
		admit("high2", 3)
		if got := serve(4); !slices.Equal(got, []string{"low1", "low2", "low3", "high2"}) {
			t.Errorf("turns handed after the age bound: %v; want the aged lows first, then high2", got)
		}
	})
}

// serveFor serves subject's line through g, at the times each serving
// says, until n jobs are handed or the line is empty; it returns the names
// handed, in the order of their slots.
func serveFor(t *testing.T, g *Gate, subject string, n int) []string {
	t.Helper()
	handed := map[string]time.Time{}
	for len(handed) < n {
		s, err := g.Serve(context.Background(), subject)
		if err != nil {
			t.Fatal(err)
		}
		maps.Copy(handed, s.Handed)
		if s.Next.IsZero() {
			break
		}
		time.Sleep(time.Until(s.Next))
	}
	return slices.SortedFunc(maps.Keys(handed), func(a, b string) int { return handed[a].Compare(handed[b]) })
}
