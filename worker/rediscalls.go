package worker

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// CountRedisCalls makes m count, in
// jobthrottle_redis_calls_total{kind,call}, every command rdb sends for
// jobthrottle: a script call (kind "script") by the script's name
// (throttle.ScriptName, admission.ScriptName: admit, bucket_fast,
// upstream_depart, wake_pop, …), any other command whose first argument
// is a key under prefix (kind "command") by the command's name (hset,
// pexpire, …). The rest of rdb's commands (asynq's, the
// application's) are not counted. A command is counted when it is sent,
// each of a pipeline's on its own, whatever its reply.
//
// It is how an operator sees what reaches Redis per task, and per idle
// worker, without MONITOR (which costs Redis every command again, and a
// script's own calls besides). It adds a hook to rdb: call it once per
// client. A nil m counts nothing.
func (m *Metrics) CountRedisCalls(rdb redis.UniversalClient, prefix string) {
	if m == nil || rdb == nil {
		return
	}
	rdb.AddHook(callCounter{m: m, prefix: prefix})
}

// callCounter is CountRedisCalls's hook.
type callCounter struct {
	m      *Metrics
	prefix string
}

func (c callCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c callCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(cmd)
		return next(ctx, cmd)
	}
}

func (c callCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			c.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (c callCounter) count(cmd redis.Cmder) {
	if kind, call := c.call(cmd.Args()); call != "" {
		c.m.redisCalls.WithLabelValues(kind, call).Inc()
	}
}

// call returns the labels a command of args is counted under; call is ""
// if it is not jobthrottle's.
func (c callCounter) call(args []any) (kind, call string) {
	if len(args) < 2 {
		return "", ""
	}
	name, _ := args[0].(string)
	name = strings.ToLower(name)
	first, _ := args[1].(string)
	switch name {
	case "evalsha", "evalsha_ro":
		return "script", scriptName(first)
	case "eval", "eval_ro":
		// After NOSCRIPT (Redis lost the script): its text, once.
		sum := sha1.Sum([]byte(first))
		return "script", scriptName(hex.EncodeToString(sum[:]))
	}
	if c.prefix != "" && strings.HasPrefix(first, c.prefix) {
		return "command", name
	}
	return "", ""
}

// scriptName is the name of jobthrottle's script of SHA1 sha; "" for
// another's.
func scriptName(sha string) string {
	if name, ok := throttle.ScriptName(sha); ok {
		return name
	}
	if name, ok := admission.ScriptName(sha); ok {
		return name
	}
	return ""
}
