package throttle

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A runner makes a limiter's calls to Redis: every script call goes through
// exec (or, batched, runPipelined), which loads scripts once, reloads them
// when Redis lost them, and applies the hooks: a failure becomes a
// *redisError reported to Options.OnRedisError, a success ends a fail-open
// period.
type runner struct {
	rdb         redis.UniversalClient
	opts        Options
	cache       scriptCache
	failingOpen atomic.Bool
}

// exec runs one call of script for operation o.
func (r *runner) exec(ctx context.Context, o op, script *redis.Script, keys []string, args []any) (*redis.Cmd, error) {
	cmd := r.run(ctx, script, keys, args...)
	return cmd, r.result(ctx, o, cmd.Err())
}

// result applies the hooks to the outcome of a call for o. A failure is
// reported to OnRedisError here unless o may fail open: failOpenOr
// reports those, once it has decided.
func (r *runner) result(ctx context.Context, o op, err error) error {
	if err == nil {
		r.redisOK()
		return nil
	}
	err = deadlineCause(ctx, err)
	if !o.failsOpen() && r.opts.OnRedisError != nil {
		r.opts.OnRedisError(err, false)
	}
	return &redisError{op: o, err: err}
}

// deadlineCause marks err as the caller's deadline when that deadline has
// passed: a call cut short by it can fail with the connection's read
// timeout (go-redis's ContextTimeoutEnabled sets it from the deadline) an
// instant before the context itself reports the deadline, and the caller
// should see the same error either way.
func deadlineCause(ctx context.Context, err error) error {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}

// redisFailed reports a Redis error and whether to admit anyway.
func (r *runner) redisFailed(ctx context.Context, err error) bool {
	open := r.opts.FailOpen && ctx.Err() == nil
	if open && !r.failingOpen.Swap(true) {
		r.opts.Logger.Warn("throttle: Redis unreachable, admitting requests (fail open)", "prefix", r.opts.Prefix, "error", err)
	}
	if r.opts.OnRedisError != nil {
		r.opts.OnRedisError(err, open)
	}
	return open
}

// redisOK notes that Redis answered, ending a fail-open period.
func (r *runner) redisOK() {
	if r.failingOpen.Load() && r.failingOpen.Swap(false) {
		r.opts.Logger.Info("throttle: Redis answers again, limits apply", "prefix", r.opts.Prefix)
	}
}

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
// not, and again if Redis has lost it. A call that the fast bucket script
// can decide goes to it instead (fastScript, scripts.go), and to script
// only if it hands the call back.
func (l *runner) run(ctx context.Context, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	if fast := fastScript(script, keys, args); fast != nil {
		if cmd := l.runScript(ctx, fast, keys, args...); !handedBack(cmd) {
			return cmd
		}
	}
	return l.runScript(ctx, script, keys, args...)
}

// runScript runs script with one EVALSHA, loading it first if this limiter
// has not, and again if Redis has lost it.
func (l *runner) runScript(ctx context.Context, script *redis.Script, keys []string, args ...any) *redis.Cmd {
	l.ensureLoaded(ctx, script)
	cmd := script.EvalSha(ctx, l.rdb, keys, args...)
	if lostScript(cmd) {
		l.reload(ctx, script)
		cmd = script.Run(ctx, l.rdb, keys, args...)
	}
	return cmd
}

// ensureLoaded loads script unless this limiter already has.
func (l *runner) ensureLoaded(ctx context.Context, script *redis.Script) {
	if _, ok := l.cache.loaded.Load(script); !ok {
		l.load(ctx, script)
	}
}

// reload loads script again after Redis lost it (a restart, SCRIPT FLUSH,
// a failover).
func (l *runner) reload(ctx context.Context, script *redis.Script) {
	l.cache.loaded.Delete(script)
	l.load(ctx, script)
}

// lostScript reports whether cmd failed because Redis does not hold the
// script; the script did not run.
func lostScript(cmd *redis.Cmd) bool {
	err := cmd.Err()
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

// load sends SCRIPT LOAD unless another goroutine just did. A failure is
// left to the call that follows, which reports it.
func (l *runner) load(ctx context.Context, script *redis.Script) {
	l.cache.mu.Lock()
	defer l.cache.mu.Unlock()
	if _, ok := l.cache.loaded.Load(script); ok {
		return
	}
	if script.Load(ctx, l.rdb).Err() == nil {
		l.cache.loaded.Store(script, struct{}{})
	}
}

// runPipelined runs script once per call, all in one go-redis pipeline,
// loading it first as run does, each call going to the fast bucket script
// where run would send it. Calls that meet NOSCRIPT (they did not run) are
// sent again after a reload, and calls the fast script hands back are sent
// again to script, in at most two more pipelines. It returns the commands
// in the order of calls; a pipeline error is each command's error.
func (l *runner) runPipelined(ctx context.Context, script *redis.Script, calls []*batchedCall) []*redis.Cmd {
	uses := make([]*redis.Script, len(calls))
	todo := make([]int, len(calls))
	for i, c := range calls {
		uses[i], todo[i] = script, i
		if fast := fastScript(script, c.keys, c.args); fast != nil {
			uses[i] = fast
		}
	}
	cmds := make([]*redis.Cmd, len(calls))
	for pass := 0; pass < 3 && len(todo) > 0; pass++ {
		for _, i := range todo {
			l.ensureLoaded(ctx, uses[i])
		}
		var again []int
		reloaded := map[*redis.Script]bool{}
		for j, cmd := range l.pipeline(ctx, calls, uses, todo) {
			i := todo[j]
			cmds[i] = cmd
			switch {
			case lostScript(cmd):
				if !reloaded[uses[i]] {
					reloaded[uses[i]] = true
					l.reload(ctx, uses[i])
				}
				again = append(again, i)
			case handedBack(cmd):
				uses[i] = script
				again = append(again, i)
			}
		}
		todo = again
	}
	return cmds
}

// pipeline sends one EVALSHA per call of todo, calls[i] to uses[i], in one
// go-redis pipeline, and returns the commands in the order of todo.
func (l *runner) pipeline(ctx context.Context, calls []*batchedCall, uses []*redis.Script, todo []int) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(todo))
	_, _ = l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for j, i := range todo {
			cmds[j] = uses[i].EvalSha(ctx, p, calls[i].keys, calls[i].args...)
		}
		return nil
	})
	return cmds
}
