package worker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// CountRedisCalls counts what a client sends for jobthrottle, by what it
// does: a limiter's decision by its script, a wake-up by the ledger's
// script (also when Redis lost it and go-redis sends its text), a command
// on a key under the prefix by its name, pipelined ones each; other
// commands (asynq's keys, the application's) not at all.
func TestCountRedisCallsByScriptAndCommand(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		prefix := redistest.Prefix(t)
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		m.CountRedisCalls(rdb, prefix)
		calls := func(call string) float64 {
			kind := "script"
			if call == "hset" || call == "get" {
				kind = "command"
			}
			return testutil.ToFloat64(m.redisCalls.WithLabelValues(kind, call))
		}

		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10).WithBurst(1)})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		for range 3 {
			if _, err := lim.Allow(ctx, "acme"); err != nil {
				t.Fatal(err)
			}
		}
		if got := calls("bucket_fast"); got != 3 {
			t.Errorf("bucket_fast: %v calls, want the 3 Allows", got)
		}

		w, err := admission.NewWakeups(rdb, prefix+"{wakeups}")
		if err != nil {
			t.Fatal(err)
		}
		// A fresh Redis holds no script: go-redis's EVALSHA fails with
		// NOSCRIPT and it sends the script's text (EVAL), which loads it.
		if err := w.Add(ctx, "task-1", time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		if got := calls("wake_add"); got != 2 {
			t.Errorf("wake_add: %v calls, want 2 (EVALSHA, then EVAL)", got)
		}
		if err := w.Add(ctx, "task-2", time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		if got := calls("wake_add"); got != 3 {
			t.Errorf("wake_add: %v calls, want 3 (EVALSHA)", got)
		}
		// Redis loses its scripts: the text again.
		if err := rdb.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if err := w.Add(ctx, "task-3", time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		if got := calls("wake_add"); got != 5 {
			t.Errorf("wake_add after SCRIPT FLUSH: %v calls, want 5 (EVALSHA, then EVAL)", got)
		}

		if err := rdb.HSet(ctx, prefix+"!limits", "api", "gcra 10 per 1s").Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Get(ctx, prefix+"a")
			p.Get(ctx, prefix+"b")
			p.Get(ctx, "asynq:{default}:pending")
			return nil
		}); err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		rdb.Get(ctx, "asynq:{default}:active")
		if got := calls("hset"); got != 1 {
			t.Errorf("hset: %v calls, want 1", got)
		}
		if got := calls("get"); got != 2 {
			t.Errorf("get: %v calls, want the 2 on the prefix's keys, not asynq's", got)
		}
		if n := testutil.CollectAndCount(m.redisCalls); n != 4 {
			t.Errorf("%d label values, want 4 (bucket_fast, wake_add, hset, get)", n)
		}
	})
}

// The names are the scripts' own: every script throttle and admission
// send has one, and a SHA of neither has none.
func TestScriptNames(t *testing.T) {
	for _, sha := range []string{"", "0000000000000000000000000000000000000000"} {
		if name := scriptName(sha); name != "" {
			t.Errorf("scriptName(%q) = %q, want none", sha, name)
		}
	}
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		// Every script this client loads is named (some load in the
		// background: read once the limiter is closed).
		loaded := &loads{}
		rdb.AddHook(loadHook{loaded})
		prefix := redistest.Prefix(t)
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "api", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(10)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := lim.Allow(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		if _, err := lim.Admit(ctx, throttle.AdmitRequest{Subject: "acme", N: 1}); err != nil {
			t.Fatal(err)
		}
		if _, err := lim.Upstream().Depart(ctx, "acme", time.Second); err != nil {
			t.Fatal(err)
		}
		if err := lim.Close(); err != nil {
			t.Fatal(err)
		}
		loaded.mu.Lock()
		defer loaded.mu.Unlock()
		if len(loaded.srcs) == 0 {
			t.Fatal("no script loaded")
		}
		for _, src := range loaded.srcs {
			sha := redis.NewScript(src).Hash()
			if scriptName(sha) == "" {
				t.Errorf("a script loaded (%.60q…) has no name", src)
			}
		}
	})
}

// loads are the texts of the SCRIPT LOADs a loadHook saw.
type loads struct {
	mu   sync.Mutex
	srcs []string
}

// loadHook notes the text of every SCRIPT LOAD.
type loadHook struct{ l *loads }

func (h loadHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h loadHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if a := cmd.Args(); len(a) == 3 && a[0] == "script" && a[1] == "load" {
			h.l.mu.Lock()
			h.l.srcs = append(h.l.srcs, a[2].(string))
			h.l.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (h loadHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
