package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// simCounts counts, in one fleet process, the commands its simulated
// workers' clients send (a hook on each client): the limiter's script calls
// by rule, the wake-up ledger's looks (wake_pop.lua's replies of three values or more),
// the looks that took nothing and its writes, per shard, every other
// command by name, and each worker's total. Commands a client sends
// outside its hooks (a subscription's PING, the cluster client's CLUSTER
// SLOTS) are not here: the servers' INFO commandstats count them.
type simCounts struct {
	shard map[string]int // ledger key -> shard index
	rules []string       // the limiter's rule names, as keys end

	limiter []atomic.Int64 // by rule index
	looks   []atomic.Int64 // by shard
	empty   []atomic.Int64
	writes  []atomic.Int64
	perW    []atomic.Int64 // every hooked command, by worker

	mu    sync.Mutex
	other map[string]int64
}

func newSimCounts(ledgerKeys, rules []string, workers int) *simCounts {
	c := &simCounts{shard: map[string]int{}, rules: rules, other: map[string]int64{},
		limiter: make([]atomic.Int64, len(rules)), looks: make([]atomic.Int64, len(ledgerKeys)),
		empty: make([]atomic.Int64, len(ledgerKeys)), writes: make([]atomic.Int64, len(ledgerKeys)),
		perW: make([]atomic.Int64, workers)}
	for i, k := range ledgerKeys {
		c.shard[k] = i
	}
	return c
}

// simCountSnap is a simCounts at one moment, as a child reports it.
type simCountSnap struct {
	Limiter map[string]int64 `json:"limiter"` // script calls by rule
	Looks   []int64          `json:"looks"`   // by shard
	Empty   []int64          `json:"empty"`
	Writes  []int64          `json:"writes"`
	Other   map[string]int64 `json:"other,omitempty"`
	PerW    []int64          `json:"per_worker"`
}

func (c *simCounts) snap() simCountSnap {
	load := func(v []atomic.Int64) []int64 {
		out := make([]int64, len(v))
		for i := range v {
			out[i] = v[i].Load()
		}
		return out
	}
	s := simCountSnap{Limiter: map[string]int64{}, Looks: load(c.looks), Empty: load(c.empty), Writes: load(c.writes), PerW: load(c.perW), Other: map[string]int64{}}
	for i, r := range c.rules {
		s.Limiter[r] = c.limiter[i].Load()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, v := range c.other {
		s.Other[k] = v
	}
	return s
}

// hook returns the redis.Hook that counts worker w's commands.
func (c *simCounts) hook(w int) redis.Hook { return &simHook{c: c, w: w} }

type simHook struct {
	c *simCounts
	w int
}

func (h *simHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *simHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.c.count(h.w, cmd)
		return err
	}
}

func (h *simHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			h.c.count(h.w, cmd)
		}
		return err
	}
}

func (c *simCounts) count(w int, cmd redis.Cmder) {
	c.perW[w].Add(1)
	name := strings.ToLower(cmd.Name())
	args := cmd.Args()
	if (name == "evalsha" || name == "eval") && len(args) > 3 {
		key, _ := args[3].(string)
		if i, ok := c.shard[key]; ok {
			c.ledgerCall(i, cmd)
			return
		}
		_, tail, _ := strings.Cut(key, "}:")
		for i, r := range c.rules {
			if strings.HasPrefix(tail, r) {
				c.limiter[i].Add(1)
				return
			}
		}
	}
	c.mu.Lock()
	c.other[name]++
	c.mu.Unlock()
}

// ledgerCall counts a script call on ledger shard i: a look if it answered
// three values or more (wake_pop.lua), else a write.
func (c *simCounts) ledgerCall(i int, cmd redis.Cmder) {
	if rc, ok := cmd.(*redis.Cmd); ok {
		if reply, _ := rc.Val().([]any); len(reply) >= 3 {
			c.looks[i].Add(1)
			if due, _ := reply[0].([]any); len(due) == 0 {
				c.empty[i].Add(1)
			}
			return
		}
	}
	c.writes[i].Add(1)
	kind := "ledger write: job"
	switch args := cmd.Args(); {
	case cmd.Err() != nil:
		kind = "ledger write: failed (" + firstWord(cmd.Err().Error()) + ")"
	case len(args) > 4 && strings.HasPrefix(fmt.Sprint(args[4]), "0:"):
		kind = "ledger write: line"
	}
	c.mu.Lock()
	c.other[kind]++
	c.mu.Unlock()
}

func firstWord(s string) string {
	w, _, _ := strings.Cut(s, " ")
	return w
}
