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
	calendar    *calendarStamp // the windows of CalendarWindow rules; nil without (calendar_stamp.go)
}

// exec runs one call of script for operation o.
func (r *runner) exec(ctx context.Context, o op, script *redis.Script, keys []string, args []any) (*redis.Cmd, error) {
	cmd := r.run(ctx, script, evalLine(keys, args))
	return cmd, r.result(ctx, o, cmd.Err())
}

// A script call is sent as one command line, the []any go-redis writes:
// "evalsha", the script's SHA1 (set by send, for the script it goes to),
// the number of keys, the keys, then the arguments. Building it once per
// call, instead of keys and arguments that go-redis's EvalSha copies into
// a line of its own, boxing the name, the SHA1 and each key again, saves
// an Allow five of its allocations (BENCHMARKS.md, issue 14). A policy
// whose calls the fast bucket script decides builds its allow and reserve
// lines in that script's shorter form (scripts.go).

// lineHead is the length of a line before its keys.
const lineHead = 3

// newLine returns a line for nkeys keys and nargs arguments, its head set
// but for the SHA1; the caller fills in the keys and arguments.
func newLine(nkeys, nargs int) []any {
	line := make([]any, lineHead+nkeys+nargs)
	line[0], line[2] = "evalsha", nkeys
	return line
}

// evalLine returns the line of a call of keys and args.
func evalLine(keys []string, args []any) []any {
	line := newLine(len(keys), len(args))
	for i, k := range keys {
		line[lineHead+i] = k
	}
	copy(line[lineHead+len(keys):], args)
	return line
}

// lineArgs returns how many keys a line has, and its arguments.
func lineArgs(line []any) (int, []any) {
	n := line[2].(int)
	return n, line[lineHead+n:]
}

// lineCall returns a line's keys and arguments, for the calls that need
// them apart (EVAL after NOSCRIPT, request's callers).
func lineCall(line []any) ([]string, []any) {
	n := line[2].(int)
	keys := make([]string, n)
	for i := range keys {
		keys[i] = line[lineHead+i].(string)
	}
	return keys, line[lineHead+n:]
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
	if !o.failsOpen() {
		r.report(ctx, err, false)
	}
	return &redisError{op: o, err: err}
}

// report passes a failed call's error to OnRedisError, unless the call's
// caller ended it: a Wait cancelled, or past its deadline, is not a Redis
// failure, and counting it as one would raise an operator's alarm every
// time a task times out. A deadline the library set on its own call (a
// refund's, a renewal's: ownTimeout) is one.
func (r *runner) report(ctx context.Context, err error, open bool) {
	if r.opts.OnRedisError != nil && !callerEnded(ctx) {
		r.opts.OnRedisError(err, open)
	}
}

// errOwnTimeout is the cause of a deadline ownTimeout set.
var errOwnTimeout = errors.New("throttle: the call's time bound passed")

// ownDeadline is the context key under which ownTimeout keeps its deadline.
type ownDeadline struct{}

// ownTimeout bounds a call the library makes on its own behalf (a refund,
// a renewal, a lease) to d, marking the bound as the library's so that
// report counts the call as failed when it passes.
func ownTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	dl := time.Now().Add(d)
	return context.WithDeadlineCause(context.WithValue(ctx, ownDeadline{}, dl), dl, errOwnTimeout)
}

// callerEnded reports whether ctx ended by its caller's doing: cancelled,
// or past a deadline that is not ownTimeout's. A deadline counts from the
// instant it passes, before ctx reports it, as in deadlineCause.
func callerEnded(ctx context.Context) bool {
	if errors.Is(context.Cause(ctx), errOwnTimeout) {
		return false
	}
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	if !ok || time.Now().Before(dl) {
		return false
	}
	own, isOwn := ctx.Value(ownDeadline{}).(time.Time)
	return !isOwn || !own.Equal(dl)
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
	r.report(ctx, err, open)
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
	loaded sync.Map // *redis.Script -> its SHA1 (a string, boxed once)
}

// run runs the call of line with one EVALSHA of script, loading it first
// if this limiter has not, and again if Redis has lost it. A call built
// for the fast bucket script goes to it instead (fastScript, scripts.go),
// and in allow.lua's form to script only if it hands the call back. A
// deciding call of CalendarWindow rules carries their windows, and is sent
// once more if Redis's clock was outside them (calendar_stamp.go).
func (l *runner) run(ctx context.Context, script *redis.Script, line []any) *redis.Cmd {
	if !l.calendar.deciding(line) {
		return l.runLine(ctx, script, line)
	}
	l.calendar.stamp(line, l.calendar.estimate())
	cmd := l.runLine(ctx, script, line)
	if l.calendar.learn(line, cmd) && resendable(line) {
		l.calendar.stamp(line, l.calendar.estimate())
		cmd = l.runLine(ctx, script, line)
		l.calendar.learn(line, cmd)
	}
	return cmd
}

// runLine is run without the calendar's windows.
func (l *runner) runLine(ctx context.Context, script *redis.Script, line []any) *redis.Cmd {
	if fast := fastScript(script, line); fast != nil {
		cmd := l.send(ctx, fast, line)
		if !handedBack(cmd) {
			return cmd
		}
		line = allowLine(script, line)
	}
	return l.send(ctx, script, line)
}

// send sends line to script with one EVALSHA, loading script first if
// this limiter has not, and again, then with EVALSHA falling back to
// EVAL, if Redis has lost it.
func (l *runner) send(ctx context.Context, script *redis.Script, line []any) *redis.Cmd {
	cmd := l.evalsha(ctx, script, line)
	_ = l.rdb.Process(ctx, cmd)
	if lostScript(cmd) {
		l.reload(ctx, script)
		keys, args := lineCall(line)
		cmd = script.Run(ctx, l.rdb, keys, args...)
	}
	return cmd
}

// evalsha returns the command that sends line to script, loading script
// first if this limiter has not.
func (l *runner) evalsha(ctx context.Context, script *redis.Script, line []any) *redis.Cmd {
	line[1] = l.ensureLoaded(ctx, script)
	cmd := redis.NewCmd(ctx, line...)
	if line[2].(int) > 0 {
		cmd.SetFirstKeyPos(lineHead) // as go-redis's EvalSha: a cluster routes by the first key
	}
	return cmd
}

// ensureLoaded loads script unless this limiter already has, and returns
// its SHA1, boxed once.
func (l *runner) ensureLoaded(ctx context.Context, script *redis.Script) any {
	if sha, ok := l.cache.loaded.Load(script); ok {
		return sha
	}
	l.load(ctx, script)
	return script.Hash()
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
	l.loadUnlocked(ctx, script)
}

// loadUnlocked is load without its lock, for a load ahead of use that
// must not hold up a call (Limiter.loadUpstream): two that meet may both
// send SCRIPT LOAD, which is harmless.
func (l *runner) loadUnlocked(ctx context.Context, script *redis.Script) {
	if _, ok := l.cache.loaded.Load(script); ok {
		return
	}
	if script.Load(ctx, l.rdb).Err() == nil {
		l.cache.loaded.Store(script, any(script.Hash()))
	}
}

// runPipelined runs script once per call, all in one go-redis pipeline,
// loading it first as run does, each call going to the fast bucket script
// where run would send it (in allow.lua's form to script if handed back). Calls that meet NOSCRIPT (they did not run) are
// sent again after a reload, and calls the fast script hands back are sent
// again to script, in at most two more pipelines. It returns the commands
// in the order of calls; a pipeline error is each command's error.
func (l *runner) runPipelined(ctx context.Context, script *redis.Script, calls []*batchedCall) []*redis.Cmd {
	uses := make([]*redis.Script, len(calls))
	todo := make([]int, len(calls))
	for i, c := range calls {
		uses[i], todo[i] = script, i
		if fast := fastScript(script, c.line); fast != nil {
			uses[i] = fast
		}
	}
	cmds := make([]*redis.Cmd, len(calls))
	stamp := l.calendar.deciding(calls[0].line)
	if stamp {
		t := l.calendar.estimate()
		for _, c := range calls {
			l.calendar.stamp(c.line, t)
		}
	}
	for pass := 0; pass < 3 && len(todo) > 0; pass++ {
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
				calls[i].line = allowLine(script, calls[i].line)
				again = append(again, i)
			case stamp && pass == 0 && l.calendar.learn(calls[i].line, cmd):
				l.calendar.stamp(calls[i].line, l.calendar.estimate())
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
			cmds[j] = l.evalsha(ctx, uses[i], calls[i].line)
			_ = p.Process(ctx, cmds[j])
		}
		return nil
	})
	return cmds
}
