package worker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestHandlerThrottleIsNotStacked: a handler that defers its task itself
// (handler/http after an upstream's 429) does not make its rule book turns
// however far ahead, as a throttling middleware inside the rule's does
// (admit.go, stacked rules). Taken for one, it took the rule out of its
// subject's line for good: with an upstream that answers only 429, the
// tasks already in line then waited behind turns booked past the horizon
// and came back 20-60 s after the others (issue 19).
func TestHandlerThrottleIsNotStacked(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		newLim := func(name string, l throttle.Limit) *throttle.Limiter {
			lim, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: name, Algorithm: throttle.GCRA, Limit: l})
			if err != nil {
				t.Fatal(err)
			}
			return lim
		}
		newMW := func(name string, lim *throttle.Limiter) *Middleware {
			mw, err := NewMiddleware([]TaskRule{{Name: name, Tasks: []string{"api:*"}, Limiter: lim, Subject: Fixed("api")}}, Options{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			return mw
		}
		var te *admission.ThrottledError

		mw := newMW("partner", newLim("partner", throttle.PerSecond(100)))
		answered429 := &admission.ThrottledError{Rule: "partner", Subject: "api", RetryAt: time.Now().Add(time.Second), Err: errors.New("answered 429")}
		h := mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return answered429 }))
		if err := h.ProcessTask(ctx, asynq.NewTask("api:call", nil)); !errors.As(err, &te) {
			t.Fatalf("handler's deferral: %v, want its ThrottledError", err)
		}
		if mw.ruleNamed("partner").stacked.Load() {
			t.Error("a handler's own ThrottledError marked the rule stacked: it would book past its horizon and leave its line for good")
		}

		// A middleware inside that throttles the task still does.
		outer := newMW("outer", newLim("outer", throttle.PerSecond(100)))
		inner := newMW("inner", newLim("inner", throttle.Limit{Count: 1, Period: 10 * time.Second, Burst: 1}))
		h = outer.Wrap(inner.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })))
		if err := h.ProcessTask(ctx, asynq.NewTask("api:call", nil)); err != nil {
			t.Fatalf("first task: %v", err)
		}
		time.Sleep(time.Millisecond)
		if err := h.ProcessTask(ctx, asynq.NewTask("api:call", nil)); !errors.As(err, &te) || te.Rule != "inner" {
			t.Fatalf("second task: %v, want deferred by inner", err)
		}
		if !outer.ruleNamed("outer").stacked.Load() {
			t.Error("a middleware inside that throttled the task did not mark the outer rule stacked")
		}
	})
}
