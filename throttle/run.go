package throttle

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// scriptCache remembers which scripts the limiter's Redis already holds, so
// that every decision is one EVALSHA. go-redis's Script.Run falls back to
// EVAL on NOSCRIPT, but when many goroutines make their first call at once
// (a fresh server, a restart, a new cluster shard) each of them would pay
// two round trips and send the whole script. Loading first (SCRIPT LOAD
// goes to every master of a cluster), once, with the others waiting for
// it, keeps it at one.
type scriptCache struct {
	mu     sync.Mutex
	loaded sync.Map // *redis.Script -> struct{}
}

// run runs script with one EVALSHA, loading it first if this limiter has
// not, and again if Redis has lost it.
func (l *Limiter) run(ctx context.Context, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	if _, ok := l.cache.loaded.Load(script); !ok {
		l.load(ctx, script)
	}
	cmd := script.EvalSha(ctx, l.rdb, keys, args...)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		l.cache.loaded.Delete(script)
		l.load(ctx, script)
		cmd = script.Run(ctx, l.rdb, keys, args...)
	}
	return cmd
}

// load sends SCRIPT LOAD unless another goroutine just did. A failure is
// left to the call that follows, which reports it.
func (l *Limiter) load(ctx context.Context, script *redis.Script) {
	l.cache.mu.Lock()
	defer l.cache.mu.Unlock()
	if _, ok := l.cache.loaded.Load(script); ok {
		return
	}
	if script.Load(ctx, l.rdb).Err() == nil {
		l.cache.loaded.Store(script, struct{}{})
	}
}

// pipeline sends one EVALSHA per call in one go-redis pipeline and returns
// the commands in order. A pipeline error is each command's error too.
func (l *Limiter) pipeline(ctx context.Context, calls []*batchedCall) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	_, _ = l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, c := range calls {
			cmds[i] = l.script.EvalSha(ctx, p, c.keys, c.args...)
		}
		return nil
	})
	return cmds
}
