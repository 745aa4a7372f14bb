package worker

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Three idle workers with wake-ups (Options.Asynq), each on its own Redis
// client, cost Redis at most one call every two seconds each
// (admission.DefaultIdle), not one a tick (20 a second each before): the
// loop keeping a shard's watch sleeps until its next wake-up, at most two
// seconds a shard in turn, and is told of an earlier one when it is added;
// the others check the watch no more often. On virtual time, so the count
// is exact.
func TestIdleWorkersCostHalfACallASecond(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
		if err != nil {
			t.Fatal(err)
		}
		calls := &redistest.ScriptCalls{}
		for range 3 {
			c := redistest.PipeClient(m)
			defer c.Close()
			mw := middleware(t, []TaskRule{{Name: "api", Tasks: []string{"api:*"}, Limiter: lim, Subject: Fixed("s")}}, Options{Asynq: c})
			defer mw.Close()
			time.Sleep(time.Millisecond) // each has looked once, loading the script
			calls.Count(c)
		}
		calls.Store(0)
		time.Sleep(10 * time.Second)
		if n := calls.Load(); n > 3*6 {
			t.Errorf("%d Redis script calls in 10s by three idle workers, want at most 18 (one every two seconds each)", n)
		}
		t.Logf("three idle workers: %d script calls in 10s", calls.Load())
	})
}
