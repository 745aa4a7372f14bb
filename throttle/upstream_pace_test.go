package throttle

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// A subject whose upstream taught a rate slower than its rule is admitted
// at the learned rate: a backlog of tasks parks once each, on turns spaced
// at the learned interval with no burst, from the next departure's slot
// on, so that a request sent on each turn departs at once; the rule's own
// pace comes back for a subject with nothing learned.
func TestAdmitPacedByLearnedRate(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rule := Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(5)}
		lim := mustNew(t, rdb, Options{}, rule)
		u := lim.Upstream()
		first, _ := depart(t, u, "s", 0)
		learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
		iv := 52632 * time.Microsecond // 1/(95 % of 20/s), in whole µs up
		slots := func(subject string) []time.Duration {
			var got []time.Duration
			for i := range 6 {
				a, err := lim.Admit(ctx, AdmitRequest{Subject: subject, N: 1, Caller: Caller{ID: fmt.Sprintf("%s-%d", subject, i)}})
				if err != nil {
					t.Fatal(err)
				}
				if subject == "s" && i > 0 && a.Status != Booked {
					t.Fatalf("task %d of %s: %s; want booked (it parks)", i, subject, a.Status)
				}
				got = append(got, a.Delay)
			}
			return got
		}
		for i, d := range slots("s") {
			// The probe left at 0: the next departure's slot is iv.
			if want := time.Duration(i+1) * iv; d < want-2*time.Microsecond || d > want+2*time.Microsecond {
				t.Errorf("task %d's turn is %v away; want %v (one learned interval, 1/(95 %% of 20/s), apart, no burst)", i, d, want)
			}
		}
		// Coming back at its turn, a task redeems it: one park, two calls.
		time.Sleep(2 * iv)
		a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 1, Caller: Caller{ID: "s-1"}})
		if err != nil || a.Status != Redeemed {
			t.Fatalf("task 1 back at its turn: %+v, %v; want redeemed", a, err)
		}
		// Nothing learned for "t": the rule's burst of 5, then its 10ms.
		for i, d := range slots("t") {
			want := time.Duration(max(i-4, 0)) * 10 * time.Millisecond
			if d < want-2*time.Microsecond || d > want+2*time.Microsecond {
				t.Errorf("task %d of an unlearned subject: turn %v away; want %v (the rule's pace)", i, d, want)
			}
		}
	})
}

// lua/upstream_rate.lua grows a learned rate by the constants upstream.go
// documents.
func TestUpstreamRateConstants(t *testing.T) {
	src, err := luaFiles.ReadFile("lua/upstream_rate.lua")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`local up_below, up_recover, up_grow = ([0-9.]+), ([0-9.]+), ([0-9.]+)`).FindSubmatch(src)
	if m == nil {
		t.Fatal("lua/upstream_rate.lua does not set up_below, up_recover, up_grow")
	}
	for i, want := range []float64{learnBelow, learnRecover, learnGrow} {
		if got, _ := strconv.ParseFloat(string(m[i+1]), 64); got != want {
			t.Errorf("lua/upstream_rate.lua's constant %d is %v; upstream.go says %v", i, got, want)
		}
	}
}
