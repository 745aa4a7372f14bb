package worker

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestGiveBackReported: what the worker gives back after a handler
// returned — a settled cost, a concurrency place — is bounded as the
// limiter bounds its own refunds, so a call Redis never answers is
// reported to the limiter's OnRedisError (a bound of the worker's own would
// read as the caller's deadline, and go unreported).
func TestGiveBackReported(t *testing.T) {
	for _, tc := range []struct {
		name string
		rule throttle.Rule
		cost Cost
		run  func(ctx context.Context) error
	}{
		{"settle", throttle.Rule{Name: "tpm", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)}, FixedCost(40),
			func(ctx context.Context) error { return SetCost(ctx, 10) }},
		{"release", throttle.Rule{Name: "c", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 2, Period: time.Minute}}, nil,
			func(context.Context) error { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			redistest.Virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
				rdb := redistest.PipeClient(m)
				defer rdb.Close()
				var armed atomic.Bool
				var reported atomic.Int32
				rdb.AddHook(redistest.HangScripts{Armed: &armed})
				lim, err := throttle.New(rdb, throttle.Options{OnRedisError: func(error, bool) { reported.Add(1) }}, tc.rule)
				if err != nil {
					t.Fatal(err)
				}
				defer lim.Close()
				mw, err := NewMiddleware([]TaskRule{{Name: tc.rule.Name, Tasks: []string{"job"}, Limiter: lim, Subject: Fixed("api"), Cost: tc.cost}}, Options{Logger: quiet})
				if err != nil {
					t.Fatal(err)
				}
				err = mw.Wrap(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
					err := tc.run(ctx)
					armed.Store(true) // Redis stops answering as the handler returns
					return err
				})).ProcessTask(context.Background(), asynq.NewTask("job", nil))
				if err != nil {
					t.Fatalf("handler: %v", err)
				}
				if got := reported.Load(); got != 1 {
					t.Errorf("the %s, unanswered, reported %d times to OnRedisError; want 1", tc.name, got)
				}
			})
		})
	}
}
