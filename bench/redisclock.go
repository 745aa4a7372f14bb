package main

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// redisClock records the Redis time (µs) of every permit jobthrottle's
// driver script admits on one client. The wall-clock time Wait returned
// lags the admission by the reply's return and the waiter's wake-up, and
// that lag varies: a permit can cross the edge of a 1 s window on the
// client's clock while on Redis's clock, which the library's scripts
// decide on, it did not. Every process talks to the same redis-server, so
// these times merge onto one clock.
//
// A reservation cancelled after it was recorded would still count, but
// the benchmark cancels none (its Waits run under a deadline far past the
// end); the parent checks that the count matches the permits admitted.
type redisClock struct {
	mu sync.Mutex
	us []int64
}

var _ redis.Hook = (*redisClock)(nil)

func (*redisClock) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *redisClock) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		c.record(cmd)
		return err
	}
}

// ProcessPipelineHook reads pipelined decisions too, so that none is missed
// should the library ever batch them.
func (c *redisClock) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			c.record(cmd)
		}
		return err
	}
}

func (c *redisClock) record(cmd redis.Cmder) {
	at, n, ok := driverAdmission(cmd)
	if !ok {
		return
	}
	c.mu.Lock()
	for range n {
		c.us = append(c.us, at)
	}
	c.mu.Unlock()
}

// sorted returns the recorded times in ascending order.
func (c *redisClock) sorted() []int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Sorted(slices.Values(c.us))
}

// driverAdmission reads one command that may be a decision of
// jobthrottle's allow script (throttle/lua/allow.lua): EVALSHA or EVAL
// with ARGV[1] 'allow' or 'reserve' and ARGV[2] = n. If Redis admitted it,
// it returns the admission's Redis time in µs and n. Only what allow.lua
// documents is read: the reply {ok, rule, remaining, delay µs, reset µs,
// Redis now µs, tickets…}. A reservation's permits come at now + delay,
// its slot; allow's come at now (the library ignores an admitted allow's
// delay too).
func driverAdmission(cmd redis.Cmder) (atUs int64, n int, ok bool) {
	if cmd.Err() != nil {
		return 0, 0, false
	}
	if name := strings.ToLower(cmd.Name()); name != "evalsha" && name != "eval" {
		return 0, 0, false
	}
	args := cmd.Args()
	if len(args) < 3 {
		return 0, 0, false
	}
	nkeys, ok := asInt(args[2])
	if !ok || nkeys < 0 || len(args) < 5+nkeys {
		return 0, 0, false
	}
	op, _ := args[3+nkeys].(string)
	if op != "allow" && op != "reserve" {
		return 0, 0, false
	}
	n, ok = asInt(args[4+nkeys])
	if !ok || n < 1 {
		return 0, 0, false
	}
	c, isCmd := cmd.(*redis.Cmd)
	if !isCmd {
		return 0, 0, false
	}
	reply, _ := c.Val().([]any)
	if len(reply) < 6 {
		return 0, 0, false
	}
	admitted, _ := reply[0].(int64)
	delay, ok1 := reply[3].(int64)
	now, ok2 := reply[5].(int64)
	if admitted != 1 || !ok1 || !ok2 {
		return 0, 0, false
	}
	if op == "allow" {
		delay = 0
	}
	return now + delay, n, true
}

// asInt reads a command argument as an int: go-redis keeps the Go value it
// was given (the library passes numkeys and n as int).
func asInt(v any) (int, bool) {
	switch x := v.(type) {
	case int:
		return x, true
	case int64:
		return int(x), true
	case string:
		i, err := strconv.Atoi(x)
		return i, err == nil
	}
	return 0, false
}
