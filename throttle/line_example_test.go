package throttle_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/redis/go-redis/v9"
)

// Queued tasks that can leave and come back: Admit books turns at most a
// Horizon ahead, and the tasks past it wait in the subject's line, charged
// nothing, until ServeLine books their turns as they come within it.
func ExampleLimiter_ServeLine() {
	m, err := miniredis.Run()
	if err != nil {
		panic(err)
	}
	defer m.Close()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	m.SetTime(t0) // Redis's clock, which stands still until moved
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	ctx := context.Background()

	lim, _ := throttle.New(rdb, throttle.Options{},
		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1).WithBurst(1)},
	)
	const horizon = 2 * time.Second
	for _, id := range []string{"task-1", "task-2", "task-3", "task-4", "task-5"} {
		a, err := lim.Admit(ctx, throttle.AdmitRequest{Subject: "acct", N: 1, Caller: throttle.Caller{ID: id}, Horizon: horizon})
		if err != nil {
			panic(err)
		}
		if a.InLine {
			fmt.Printf("%s: in line, back by +%v at the latest\n", id, a.Slot.Sub(t0))
			continue
		}
		fmt.Printf("%s: %s, turn at +%v\n", id, a.Status, a.Slot.Sub(t0))
	}
	serve := func() {
		s, err := lim.ServeLine(ctx, "acct", horizon, throttle.Limit{})
		if err != nil {
			panic(err)
		}
		for _, id := range slices.Sorted(maps.Keys(s.Handed)) {
			fmt.Printf("  handed %s its turn at +%v\n", id, s.Handed[id].Sub(t0))
		}
		fmt.Println("  serve again:", !s.Next.IsZero())
	}
	fmt.Println("serving at +0s")
	serve()
	m.SetTime(t0.Add(2 * time.Second))
	fmt.Println("serving at +2s")
	serve()
	// Output:
	// task-1: granted, turn at +0s
	// task-2: booked, turn at +1s
	// task-3: booked, turn at +2s
	// task-4: in line, back by +4s at the latest
	// task-5: in line, back by +6s at the latest
	// serving at +0s
	//   serve again: true
	// serving at +2s
	//   handed task-4 its turn at +3s
	//   handed task-5 its turn at +4s
	//   serve again: false
}
