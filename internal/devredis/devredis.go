// Package devredis runs an in-memory Redis (miniredis) on loopback for the
// worker binary and the examples when no Redis is given: enough for asynq
// and every throttle script, with nothing to install. Its data is lost when
// the process exits; production uses a real Redis.
//
// Imports: miniredis only; it must not import any package of this module,
// so the binaries and examples can use it without pulling in another.
package devredis

import (
	"fmt"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
)

// expireEvery is how often key TTLs are advanced: miniredis expires keys
// only when told to (FastForward).
const expireEvery = time.Second

// Server is a running miniredis.
type Server struct {
	mr   *miniredis.Miniredis
	stop chan struct{}
	done sync.WaitGroup
}

// Start starts a miniredis listening on addr ("127.0.0.1:0" for any free
// port), whose key TTLs run in real time.
func Start(addr string) (*Server, error) {
	mr := miniredis.NewMiniRedis()
	if err := mr.StartAddr(addr); err != nil {
		return nil, fmt.Errorf("devredis: starting an in-memory Redis on %s: %w", addr, err)
	}
	s := &Server{mr: mr, stop: make(chan struct{})}
	s.done.Add(1)
	go s.expire()
	return s, nil
}

// expire advances TTLs by the time that passed, so keys expire about on
// time. (Redis TIME, which the scripts read, is the real clock already.)
func (s *Server) expire() {
	defer s.done.Done()
	t := time.NewTicker(expireEvery)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			s.mr.FastForward(now.Sub(last))
			last = now
		}
	}
}

// Addr returns the "host:port" the server listens on.
func (s *Server) Addr() string { return s.mr.Addr() }

// URL returns a redis:// URL for the server, for other processes.
func (s *Server) URL() string { return "redis://" + s.mr.Addr() + "/0" }

// Close stops the server.
func (s *Server) Close() {
	close(s.stop)
	s.done.Wait()
	s.mr.Close()
}
