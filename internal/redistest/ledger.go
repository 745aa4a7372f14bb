package redistest

import (
	"context"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// LedgerCalls counts the calls that the clients it hooks make to a
// wake-up ledger (package admission) kept at the given keys: looks (the
// wake loops' takes, scripts on a ledger key that answer three values or more),
// the looks that took nothing, and writes (other scripts on a ledger key,
// ZREMs).
type LedgerCalls struct {
	keys map[string]bool

	mu                   sync.Mutex
	looks, empty, writes int
}

// CountLedger returns a LedgerCalls for the ledger at keys (Wakeups.Keys).
// Hook it on each client with AddHook.
func CountLedger(keys []string) *LedgerCalls {
	l := &LedgerCalls{keys: map[string]bool{}}
	for _, k := range keys {
		l.keys[k] = true
	}
	return l
}

// Counts returns the looks, the looks that took nothing, and the writes.
func (l *LedgerCalls) Counts() (looks, empty, writes int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.looks, l.empty, l.writes
}

// DialHook is part of redis.Hook.
func (l *LedgerCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook is part of redis.Hook; the ledger sends no
// pipelines.
func (l *LedgerCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// ProcessHook is part of redis.Hook: it counts each command once answered.
func (l *LedgerCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		l.count(cmd)
		return err
	}
}

func (l *LedgerCalls) count(cmd redis.Cmder) {
	args := cmd.Args()
	var key string
	switch name := strings.ToLower(cmd.Name()); {
	case (name == "evalsha" || name == "eval") && len(args) > 3:
		key, _ = args[3].(string)
	case name == "zrem" && len(args) > 1:
		key, _ = args[1].(string)
	}
	if !l.keys[key] {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if c, ok := cmd.(*redis.Cmd); ok {
		if reply, _ := c.Val().([]any); len(reply) >= 3 {
			l.looks++
			if due, _ := reply[0].([]any); len(due) == 0 {
				l.empty++
			}
			return
		}
	}
	l.writes++
}
