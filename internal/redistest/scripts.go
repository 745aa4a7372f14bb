package redistest

import (
	"context"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// ScriptCalls counts the script calls (EVALSHA and EVAL) that the clients
// it hooks send: the round trips of the limiters' decisions. Load and
// Store read and reset it.
type ScriptCalls struct{ atomic.Int64 }

// CountScripts returns a ScriptCalls hooked on rdb.
func CountScripts(rdb redis.UniversalClient) *ScriptCalls {
	c := &ScriptCalls{}
	c.Count(rdb)
	return c
}

// Count adds rdb's script calls to c's (several clients, one count).
func (c *ScriptCalls) Count(rdb redis.UniversalClient) { rdb.AddHook(scriptHook{c}) }

type scriptHook struct{ c *ScriptCalls }

func (h scriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h scriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if name := strings.ToLower(cmd.Name()); name == "evalsha" || name == "eval" {
			h.c.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h scriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
