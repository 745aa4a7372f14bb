package main

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// floorName is a reference, not a limiter anyone ships: the least a GCRA
// allow on Redis's clock can send and run. It shows how far a one-script
// Allow can go past redis_rate at all, unbatched, on this client: each
// call is still one EVALSHA round trip through go-redis, and the script
// still makes the three Redis calls any such limiter must (TIME, GET,
// SET with an expiry), with nothing else: no burst beyond a plain
// GCRA's, no remaining count, no retry-after, a one-integer reply.
const floorName = "floor: least GCRA script (reference)"

// floorScript is that script. KEYS[1]: the TAT in µs as an integer;
// ARGV[1]: the interval T in µs; ARGV[2]: the burst.
var floorScript = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local T = ARGV[1] + 0
local tat = redis.call('GET', KEYS[1])
if tat then
  tat = tat + 0
  if tat < now then tat = now end
else
  tat = now
end
local new = tat + T
if new - ARGV[2] * T > now then return 0 end
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', string.format('%d', (new - now + 999) / 1000))
return 1
`)

// floor is floorScript as an Allower, with the arguments boxed once.
type floor struct {
	rdb  redis.UniversalClient
	args []any // T µs, burst
}

var _ Allower = floor{}

func newFloor(rdb redis.UniversalClient, r, burst int) floor {
	return floor{rdb, []any{1_000_000 / r, burst}}
}

func (f floor) Allow(ctx context.Context, key string) (bool, error) {
	n, err := floorScript.Run(ctx, f.rdb, []string{key}, f.args...).Int()
	return n == 1, err
}

func (f floor) Wait(context.Context, string) error {
	return fmt.Errorf("bench: %s is measured for Allow only", floorName)
}
