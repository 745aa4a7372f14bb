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

// HangScripts makes the script calls (EVALSHA and EVAL) of the clients it
// hooks wait, once Armed is set, until the call's context ends: a Redis
// that stopped answering.
type HangScripts struct{ Armed *atomic.Bool }

// ArmScripts sets Armed at the first script call of the clients it hooks
// (which goes through): from then on, a HangScripts sharing Armed hangs.
type ArmScripts struct{ Armed *atomic.Bool }

func isScript(cmd redis.Cmder) bool {
	name := strings.ToLower(cmd.Name())
	return name == "evalsha" || name == "eval"
}

// ProcessHook implements redis.Hook.
func (h HangScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) && h.Armed.Load() {
			<-ctx.Done()
			return ctx.Err()
		}
		return next(ctx, cmd)
	}
}

// ProcessHook implements redis.Hook.
func (h ArmScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) {
			h.Armed.Store(true)
		}
		return next(ctx, cmd)
	}
}

// DialHook implements redis.Hook.
func (HangScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook implements redis.Hook.
func (HangScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// DialHook implements redis.Hook.
func (ArmScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook implements redis.Hook.
func (ArmScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
