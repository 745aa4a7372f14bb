package admission

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestStackGiveBackReported: a turn a stack gives back, when a later gate
// parks the job, is given back under the limiter's own time bound, so a
// refund Redis never answers is reported to the limiter's OnRedisError, as
// throttle reports its own refunds (a bound of the caller's would count as
// the caller ending the call, and hide the failure).
func TestStackGiveBackReported(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		var armed atomic.Bool
		var reported atomic.Int32
		aRDB := redistest.PipeClient(m)
		defer aRDB.Close()
		aRDB.AddHook(redistest.HangScripts{Armed: &armed})
		a, err := throttle.New(aRDB, throttle.Options{OnRedisError: func(error, bool) { reported.Add(1) }},
			throttle.Rule{Name: "a", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(1).WithBurst(5)})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := throttle.New(rdb, throttle.Options{},
			throttle.Rule{Name: "b", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Minute, Burst: 1}})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if res, err := b.Allow(ctx, "s"); err != nil || !res.Allowed {
			t.Fatalf("taking b's burst: %+v, %v", res, err)
		}
		rdb.AddHook(redistest.ArmScripts{Armed: &armed}) // a's calls hang from b's admission on
		gates := make([]*Gate, 2)
		for i, lim := range []*throttle.Limiter{a, b} {
			if gates[i], err = New(lim, Options{Settings: Settings{Horizon: -1}}); err != nil {
				t.Fatal(err)
			}
		}
		stack, err := NewStack(gates...)
		if err != nil {
			t.Fatal(err)
		}
		req := Request{Subject: "s", Caller: throttle.Caller{ID: "job"}}
		d, err := stack.Admit(ctx, []Request{req, req})
		if err != nil || d.Outcome != Park || d.Gate != 1 {
			t.Fatalf("stack admit: %+v, %v; want parked by gate 1 (b's turn is a minute away)", d, err)
		}
		if got := reported.Load(); got != 1 {
			t.Errorf("a's refund, unanswered, reported %d times to OnRedisError; want 1", got)
		}
	})
}

// TestGateLeaveReported: a redeemed turn whose wait the job's context
// ended is booked again (Rebook) under the limiter's own time bound, so a
// rebooking Redis never answers is reported to OnRedisError. (A new
// turn's refund is reported by throttle's own refund calls.)
func TestGateLeaveReported(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		var armed atomic.Bool
		var reported atomic.Int32
		rdb.AddHook(redistest.HangScripts{Armed: &armed})
		lim, err := throttle.New(rdb, throttle.Options{OnRedisError: func(error, bool) { reported.Add(1) }},
			throttle.Rule{Name: "a", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		if res, err := lim.Allow(context.Background(), "s"); err != nil || !res.Allowed {
			t.Fatalf("taking the burst: %+v, %v", res, err)
		}
		g, err := New(lim, Options{Settings: Settings{Horizon: -1}})
		if err != nil {
			t.Fatal(err)
		}
		req := Request{Subject: "s", Caller: throttle.Caller{ID: "job"}}
		// Its deadline too close to wait: the job parks on a turn 100ms away.
		short, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		d, err := g.Admit(short, req)
		cancel()
		if err != nil || d.Outcome != Park || d.Status != throttle.Booked {
			t.Fatalf("first admit: %+v, %v; want parked on a booked turn", d, err)
		}
		time.Sleep(50 * time.Millisecond)
		// Back early: it waits for its redeemed turn, until its context ends.
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(10*time.Millisecond, func() { armed.Store(true); cancel() })
		if d, err := g.Admit(ctx, req); err != context.Canceled {
			t.Fatalf("back early: %+v, %v; want context.Canceled while it waits for its turn", d, err)
		}
		if got := reported.Load(); got != 1 {
			t.Errorf("the rebooking, unanswered, reported %d times to OnRedisError; want 1", got)
		}
	})
}
