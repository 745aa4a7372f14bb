package redistest

import (
	"context"
	"net"
	"testing"
	"testing/synctest"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Virtual runs f in a testing/synctest bubble against a miniredis that
// lives in the bubble too, so that Redis TIME, key expiry (ClockTTL) and
// every timer follow the bubble's fake clock: a 90-second wait takes no
// real time, and every instant is exact. The clock starts at
// 2000-01-01T00:00:00Z, on every window boundary. rdb and m are closed
// when f returns.
func Virtual(t *testing.T, f func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		m := miniredis.NewMiniRedis()
		defer m.Close()
		m.ClockTTL(true)
		rdb := PipeClient(m)
		defer rdb.Close()
		f(t, rdb, m)
	})
}

// PipeClient returns a client whose connections to m are net.Pipes
// (miniredis's Dial), which a synctest bubble can use where sockets
// cannot. Inside Virtual, use it for a second "process" on the same
// Redis. The caller closes it.
func PipeClient(m *miniredis.Miniredis) *redis.Client {
	return redis.NewClient(&redis.Options{
		// An IP address: go-redis resolves host names when the client is
		// built, which a bubble cannot do.
		Addr:   "127.0.0.1:0",
		Dialer: func(context.Context, string, string) (net.Conn, error) { return m.Dial() },
	})
}
