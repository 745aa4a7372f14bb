package throttle

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// TestLineLeftWithoutHorizon: a member of the line that comes back without
// a horizon (admission's BookAhead: its rule was found stacked while it
// waited) books its own turn and leaves the line. Left in it, it was
// handed a second turn by a serving, for a job that had run: a turn lost
// at the line's pace, and the members behind it served that much later
// (issue 19's traced run: ~400 such turns, 22 s, at the end of the run).
func TestLineLeftWithoutHorizon(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		l := mustNew(t, rdb, Options{}, Rule{Name: "gcra", Algorithm: GCRA, Limit: PerSecond(10).WithBurst(1)})
		warm(t, l)
		const n, within = 20, 11 // the first 11 take turns within the 1s horizon
		for i := range n {
			a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: fmt.Sprintf("task-%02d", i)}, Horizon: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if i >= within && !a.InLine {
				t.Fatalf("caller %d: %+v, want in line past the horizon", i, a)
			}
		}
		const left = "task-15"
		a, err := l.Admit(ctx, AdmitRequest{Subject: "acct", N: 1, Caller: Caller{ID: left}})
		if err != nil {
			t.Fatal(err)
		}
		if a.Status != Booked || a.InLine {
			t.Fatalf("%s without a horizon: %+v, want its own turn booked", left, a)
		}
		handed := map[string]bool{}
		for servings := 0; ; servings++ {
			if servings > 2*n {
				t.Fatalf("%d servings and the line is not empty: %d handed", servings, len(handed))
			}
			ls, err := l.ServeLine(ctx, "acct", time.Second, Limit{})
			if err != nil {
				t.Fatal(err)
			}
			for id := range ls.Handed {
				handed[id] = true
			}
			if ls.Next.IsZero() {
				break
			}
			time.Sleep(max(time.Until(ls.Next), ms))
		}
		if handed[left] {
			t.Errorf("%s, which booked its own turn, was handed another by a serving", left)
		}
		if want := n - within - 1; len(handed) != want {
			t.Errorf("%d handed, want the %d still in line", len(handed), want)
		}
	})
}
