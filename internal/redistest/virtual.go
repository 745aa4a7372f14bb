package redistest

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Virtual runs f in a testing/synctest bubble against a miniredis that
// lives in the bubble too, so that Redis TIME, key expiry (ClockTTL) and
// every timer follow the bubble's fake clock: a 90-second wait takes no
// real time, and every instant is exact. The clock starts at
// 2000-01-01T00:00:00Z, on every window boundary. rdb and m are closed
// when f returns, after the cleanups f registered with t.Cleanup: a
// limiter or client f closes in a cleanup still has its Redis while it
// closes (a limiter's last give-back, say, does not retry against a
// closed server until the bubble's goroutines deadlock).
func Virtual(t *testing.T, f func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		m := miniredis.NewMiniRedis()
		t.Cleanup(m.Close)
		m.ClockTTL(true)
		rdb := PipeClient(m)
		t.Cleanup(func() { rdb.Close() })
		f(t, rdb, m)
	})
}

// PipeClient returns a client whose connections to m are net.Pipes
// (miniredis's Dial), which a synctest bubble can use where sockets
// cannot. Inside Virtual, use it for a second "process" on the same
// Redis. The caller closes it.
//
// Its pool never makes a command wait for a connection (see
// [BubblePoolSize]).
func PipeClient(m *miniredis.Miniredis) *redis.Client {
	return redis.NewClient(&redis.Options{
		// An IP address: go-redis resolves host names when the client is
		// built, which a bubble cannot do.
		Addr:     "127.0.0.1:0",
		Dialer:   func(context.Context, string, string) (net.Conn, error) { return m.Dial() },
		PoolSize: BubblePoolSize,
	})
}

// BubblePoolSize is the connection pool size of a client used inside a
// synctest bubble: more connections than any test runs commands at once.
//
// go-redis keeps the timers of commands that wait for a free connection
// in one process-wide sync.Pool. A timer made inside a bubble and later
// reset outside it (or the reverse) crashes the test binary ("reset of
// synctest timer from outside bubble"), so whether a package's tests
// pass would depend on their order (-shuffle). A bubble's client that
// never waits for a connection never takes a timer from that pool, and
// never puts one there.
const BubblePoolSize = 4096

// Slow is a client hook that makes every command (and pipeline) wait rtt
// on the clock before Redis sees it: a round trip on a loaded machine, in
// a synctest bubble. rtt may change while the client is in use.
type Slow struct{ RTT *atomic.Int64 }

// DialHook dials as before.
func (Slow) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook waits RTT before the command.
func (s Slow) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		time.Sleep(time.Duration(s.RTT.Load()))
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook waits RTT before the pipeline.
func (s Slow) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		time.Sleep(time.Duration(s.RTT.Load()))
		return next(ctx, cmds)
	}
}
