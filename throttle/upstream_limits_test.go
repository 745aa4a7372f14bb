package throttle

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Limits learned of the resource bind the rules they name, at Admit and
// Settle, in every process, never looser than the rule: an input-token
// limit learned at 1,000 a second with a burst of 500 paces a rule of
// 10,000 a second (burst 2,000) at it, a settle gives back at the learned
// rate, and a learned limit above its rule changes nothing.
func TestAdmitLearnedLimits(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		rules := []Rule{
			{Name: "requests", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(10)},
			{Name: "input", Algorithm: GCRA, Limit: PerSecond(10000).WithBurst(2000)},
			{Name: "output", Algorithm: TokenBucket, Limit: PerSecond(10000).WithBurst(2000)},
		}
		learner := mustNew(t, rdb, Options{}, rules...)
		other := mustNew(t, rdb, Options{}, rules...) // another process
		for _, subject := range []string{"s", "u"} {
			if err := learner.LearnLimits(ctx, subject, map[string]LearnedLimit{
				"input":  {Limit: PerSecond(1000).WithBurst(500)},
				"output": {Limit: PerSecond(100000).WithBurst(2000)}, // above the rule: nothing
			}); err != nil {
				t.Fatal(err)
			}
		}
		admit := func(subject string, id int, c Costs) *Admission {
			a, err := other.Admit(ctx, AdmitRequest{Subject: subject, Costs: c, Caller: Caller{ID: fmt.Sprint(id)}, Wait: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			return &a
		}
		near := func(got, want time.Duration) bool { return got > want-time.Millisecond && got < want+time.Millisecond }
		for i, want := range []time.Duration{0, 0, 250 * time.Millisecond, 500 * time.Millisecond} {
			if got := admit("s", i, Costs{1, 250, 100}).Delay; !near(got, want) {
				t.Errorf("call %d of a subject with a learned input limit: turn %v away, want %v (burst 500, then 1,000 a second)", i, got, want)
			}
		}
		for i := range 4 {
			if got := admit("t", i, Costs{1, 250, 100}).Delay; got != 0 {
				t.Errorf("call %d of a subject with nothing learned: turn %v away, want 0 (the rule's burst of 2,000)", i, got)
			}
		}
		// A call that used half its estimate gives back 250 at the learned
		// rate: the next call of 500 waits 250ms, not 475ms.
		a := admit("u", 0, Costs{1, 500, 100})
		if a.Status != Granted {
			t.Fatalf("first call: %s, want granted", a.Status)
		}
		if err := a.Reservation.SettleCosts(ctx, Costs{1, 250, 100}); err != nil {
			t.Fatal(err)
		}
		if got := admit("u", 1, Costs{1, 500, 100}).Delay; !near(got, 250*time.Millisecond) {
			t.Errorf("after a settle giving 250 back: turn %v away, want 250ms", got)
		}
	})
}

// A learned burst is never taken below the cost of the request decided:
// a call larger than it is still admitted, after the learned rate's wait.
func TestLearnedBurstBelowCost(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{}, Rule{Name: "tokens", Algorithm: GCRA, Limit: PerSecond(1000).WithBurst(1000)})
		if err := lim.LearnLimits(ctx, "s", map[string]LearnedLimit{"tokens": {Limit: PerSecond(100).WithBurst(10)}}); err != nil {
			t.Fatal(err)
		}
		for i, want := range []time.Duration{0, 4 * time.Second} {
			a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 400, Caller: Caller{ID: fmt.Sprint(i)}, Wait: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if a.Delay < want-time.Millisecond || a.Delay > want+time.Millisecond {
				t.Errorf("call %d of 400 under a learned burst of 10: turn %v away, want %v", i, a.Delay, want)
			}
		}
	})
}

func TestLearnLimitsErrors(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{}, Rule{Name: "tokens", Algorithm: GCRA, Limit: PerSecond(1000)})
		for _, c := range []struct {
			learned map[string]LearnedLimit
			want    string
		}{
			{map[string]LearnedLimit{"input": {Limit: PerSecond(10)}}, "name its rules"},
			{map[string]LearnedLimit{"tokens": {Limit: Limit{Count: 0, Period: time.Second}}}, `rule "tokens": count`},
			{map[string]LearnedLimit{"tokens": {Limit: PerSecond(10).WithBurst(11)}}, "burst 11"},
			{map[string]LearnedLimit{"tokens": {Limit: PerSecond(10), Remaining: -1, HasRemaining: true}}, "remaining -1"},
		} {
			if err := lim.LearnLimits(ctx, "s", c.learned); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%v: %v; want an error saying %q", c.learned, err, c.want)
			}
		}
		if err := lim.LearnLimits(ctx, "", map[string]LearnedLimit{"tokens": {Limit: PerSecond(10)}}); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("empty subject: %v", err)
		}
	})
}

// A rate of requests learned from the upstream (issue 19) paces the
// rules a request counts once, not a rule of tokens charged hundreds per
// request: calls of 1 request and 300 tokens under a learned 20 requests
// a second are a learned interval apart, as calls of one permit are.
func TestLearnedRatePacesRequestsOnly(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{},
			Rule{Name: "requests", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(5)},
			Rule{Name: "tokens", Algorithm: GCRA, Limit: PerSecond(100000).WithBurst(10000)})
		u := lim.Upstream()
		first, _ := depart(t, u, "s", 0)
		learn(t, u, "s", first, Answer{Quota: 20, Window: time.Second})
		iv := 52632 * time.Microsecond // 1/(95 % of 20/s), in whole µs up
		for i := range 4 {
			a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", Costs: Costs{1, 300}, Caller: Caller{ID: fmt.Sprint(i)}})
			if err != nil {
				t.Fatal(err)
			}
			if want := time.Duration(i+1) * iv; a.Delay < want-2*time.Microsecond || a.Delay > want+2*time.Microsecond {
				t.Errorf("call %d: turn %v away (%s); want %v, one learned interval apart", i, a.Delay, a.Status, want)
			}
		}
	})
}

// What the resource says is left of a limit caps what the rule has
// available when the limit is learned, counted at the learned rate: a
// rule that charged 3,000 of its 10,000 at its own rate (a tenth of a
// learned interval each) has 300 left once the provider says 300.
func TestLearnedRemaining(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		lim := mustNew(t, rdb, Options{}, Rule{Name: "tokens", Algorithm: GCRA, Limit: PerSecond(10000).WithBurst(10000)})
		if _, err := lim.AllowN(ctx, "s", 3000); err != nil {
			t.Fatal(err)
		}
		if err := lim.LearnLimits(ctx, "s", map[string]LearnedLimit{"tokens": {Limit: PerSecond(1000), Remaining: 300, HasRemaining: true}}); err != nil {
			t.Fatal(err)
		}
		for i, want := range []time.Duration{0, 300 * time.Millisecond} {
			a, err := lim.Admit(ctx, AdmitRequest{Subject: "s", N: 300, Caller: Caller{ID: fmt.Sprint(i)}, Wait: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if a.Delay < want-time.Millisecond || a.Delay > want+time.Millisecond {
				t.Errorf("call %d of 300 after the provider said 300 were left: turn %v away, want %v", i, a.Delay, want)
			}
		}
	})
}
