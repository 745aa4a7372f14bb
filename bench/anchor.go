package main

import (
	"context"
	"math"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// serverAnchored is a prototype of the change notes.md proposes for
// throttle/, for the jitter lab only: a GCRA reservation whose reply
// carries Redis's clock, so that the client wakes at the slot Redis chose
// mapped onto its own monotonic clock through an offset estimated from the
// fastest recent replies, not at "reply read + delay". The script is the
// same GCRA reservation as throttle/lua/gcra.lua (one permit, no bound on
// the wait), reduced to what the lab needs.
type serverAnchored struct {
	rdb   redis.UniversalClient
	t     float64 // emission interval, µs
	burst int

	mu     sync.Mutex
	epoch  time.Time // local monotonic origin
	ring   [128]int64
	n      int
	offset int64 // min over ring of (local receive − Redis now), µs
}

// gcraNow reserves one permit and returns {delay µs, Redis now µs}.
//
// KEYS[1] -> the TAT key
// ARGV[1] -> emission interval, microseconds
// ARGV[2] -> burst
var gcraNow = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + T
local delay = math.ceil(new_tat - burst * T - now)
if delay < 0 then delay = 0 end
redis.call('SET', KEYS[1], string.format('%.17g', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1)
return {delay, now}
`)

func newServerAnchored(rdb redis.UniversalClient, r, burst int) *serverAnchored {
	return &serverAnchored{rdb: rdb, t: 1e6 / float64(r), burst: burst, epoch: time.Now(), offset: math.MaxInt64}
}

func (s *serverAnchored) Wait(ctx context.Context, key string) error {
	v, err := gcraNow.Run(ctx, s.rdb, []string{"anchor:{" + key + "}"}, s.t, s.burst).Int64Slice()
	recv := time.Since(s.epoch).Microseconds()
	if err != nil {
		return err
	}
	delay, now := v[0], v[1]
	s.mu.Lock()
	s.ring[s.n%len(s.ring)] = recv - now
	s.n++
	off := int64(math.MaxInt64)
	for i := range min(s.n, len(s.ring)) {
		off = min(off, s.ring[i])
	}
	s.offset = off
	s.mu.Unlock()
	at := s.epoch.Add(time.Duration(now+delay+off) * time.Microsecond)
	if d := time.Until(at); d > 0 {
		return sleepCtx(ctx, d)
	}
	return nil
}

// Allow is not part of the prototype; the lab only waits.
func (s *serverAnchored) Allow(ctx context.Context, key string) (bool, error) {
	return false, errNoAllow
}
