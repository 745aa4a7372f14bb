package redistest

import (
	"context"
	"maps"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// CommandCalls counts the commands the clients it hooks send, by name
// (lower case), pipelined ones each on its own: every round trip's work,
// where ScriptCalls counts only the scripts. If Only is set, it counts
// only the commands whose context it accepts (those sent on one task's
// path, say).
type CommandCalls struct {
	Only func(ctx context.Context) bool

	mu     sync.Mutex
	byName map[string]int
}

// CountCommands returns a CommandCalls hooked on rdb, counting the
// commands whose context only accepts (every command if only is nil).
func CountCommands(rdb redis.UniversalClient, only func(ctx context.Context) bool) *CommandCalls {
	c := &CommandCalls{Only: only, byName: map[string]int{}}
	rdb.AddHook(commandHook{c})
	return c
}

// Total returns how many commands were counted.
func (c *CommandCalls) Total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, v := range c.byName {
		n += v
	}
	return n
}

// ByName returns the counts by command name, and resets them if reset.
func (c *CommandCalls) ByName(reset bool) map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := maps.Clone(c.byName)
	if reset {
		clear(c.byName)
	}
	return out
}

func (c *CommandCalls) count(ctx context.Context, cmds ...redis.Cmder) {
	if c.Only != nil && !c.Only(ctx) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, cmd := range cmds {
		c.byName[strings.ToLower(cmd.Name())]++
	}
}

type commandHook struct{ c *CommandCalls }

func (h commandHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h commandHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.c.count(ctx, cmd)
		return next(ctx, cmd)
	}
}
func (h commandHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.c.count(ctx, cmds...)
		return next(ctx, cmds)
	}
}
