package httpthrottle

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A stall holds Redis up for the clients dialled through it: either the
// commands (Redis sees them only when it ends, as under CLIENT PAUSE), or
// the replies (Redis ran them on time, the process reads them late, as
// when it was paused or starved of CPU).
type stall struct {
	replies bool
	mu      sync.Mutex
	until   time.Time
}

func (s *stall) start(d time.Duration) {
	s.mu.Lock()
	s.until = time.Now().Add(d)
	s.mu.Unlock()
}

// hold sleeps until the stall, if any, ends.
func (s *stall) hold() {
	s.mu.Lock()
	d := time.Until(s.until)
	s.mu.Unlock()
	if d > 0 {
		time.Sleep(d)
	}
}

// client is a Redis client for one process, on m, through the stall.
func (s *stall) client(t *testing.T, m *miniredis.Miniredis) *redis.Client {
	rdb := redis.NewClient(&redis.Options{
		Addr: "127.0.0.1:0",
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			c, err := m.Dial()
			if err != nil {
				return nil, err
			}
			sc := &stalledConn{Conn: c, s: s, out: make(chan []byte, 64)}
			go sc.pump()
			return sc, nil
		},
	})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// stalledConn delivers what the client writes through pump, held while
// the stall holds commands, and holds what it reads while it holds
// replies.
type stalledConn struct {
	net.Conn
	s   *stall
	out chan []byte
}

func (c *stalledConn) Write(b []byte) (int, error) {
	c.out <- append([]byte(nil), b...)
	return len(b), nil
}

func (c *stalledConn) pump() {
	for b := range c.out {
		if !c.s.replies {
			c.s.hold()
		}
		if _, err := c.Conn.Write(b); err != nil {
			return
		}
	}
}

func (c *stalledConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.s.replies {
		c.s.hold()
	}
	return n, err
}

func (c *stalledConn) Close() error {
	close(c.out)
	return c.Conn.Close()
}

// A Redis stall in the middle of a backlog does not release a burst at
// the upstream: requests whose slots passed during it take new slots,
// spread at the rule's rate, whether Redis saw the calls late (its
// commands held) or answered late (its replies held). Before, the
// requests that had waited for their slots through the stall checked the
// pause after it and all left at once.
func TestTransportStallDoesNotBunch(t *testing.T) {
	for _, replies := range []bool{false, true} {
		name := "commands held"
		if replies {
			name = "replies held"
		}
		t.Run(name, func(t *testing.T) {
			virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
				up := &limitedUpstream{limit: 1000, style: styleBare}
				s := &stall{replies: replies}
				rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(1)}
				var trs []*Transport
				for range 3 {
					tr, err := New(mustNew(t, s.client(t, m), throttle.Options{}, rule), Options{Base: up})
					if err != nil {
						t.Fatal(err)
					}
					trs = append(trs, tr)
				}
				time.AfterFunc(2*time.Second, func() { s.start(2500 * time.Millisecond) })
				backlog(t, trs, 4, 120)
				calls, _ := up.log()
				if got := maxIn(calls, time.Second); got > 21 {
					t.Errorf("%d requests in one second at the upstream; want at most 21 (20/s, burst 1)", got)
				}
				least := time.Hour
				for i := 1; i < len(calls); i++ {
					least = min(least, calls[i]-calls[i-1])
				}
				if tol := throttle.DepartureTolerance(50 * time.Millisecond); least < 50*time.Millisecond-tol {
					t.Errorf("two requests %v apart at the upstream; want at least 50ms less the departure tolerance %v", least, tol)
				}
				if last := calls[len(calls)-1]; last > 9*time.Second {
					t.Errorf("120 requests took %v; want under 9s (6s at 20/s, the stall, a little more)", last)
				}
			})
		})
	}
}
