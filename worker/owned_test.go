package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// exportsRule is a rules file with one concurrency rule "exports" of
// limit places for task type "export": a task holds a place, renewed in
// the background, while its handler runs.
func exportsRule(limit int) string {
	return fmt.Sprintf("rules:\n  - {name: exports, tasks: [export], subject: {fixed: all}, algorithm: concurrency, limit: %d, lease: 1s}\n", limit)
}

// holding runs one task of type "export" through mw, in the background,
// until release is closed; it returns once the task's handler runs (and
// holds its place), and the task's error comes on the channel.
func holding(mw *Middleware, release chan struct{}) <-chan error {
	started, done := make(chan struct{}), make(chan error, 1)
	go func() {
		done <- mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
			close(started)
			<-release
			return nil
		})).ProcessTask(context.Background(), asynq.NewTask("export", nil))
	}()
	<-started
	return done
}

// closedLimiter reports whether lim has been closed: its calls return
// throttle.ErrClosed.
func closedLimiter(t *testing.T, lim *throttle.Limiter) bool {
	t.Helper()
	_, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "probe", N: 1, Caller: throttle.Caller{ID: "probe"}})
	return errors.Is(err, throttle.ErrClosed)
}

// TestDrainClosesItsLimiters: the limiters FromRules built are closed by
// Drain once no task uses them (a task holding a place keeps it renewed
// until its handler returns), after which none of their goroutines runs
// and a later task is deferred; a limiter given to NewMiddleware is the
// caller's, and still works after Drain. On virtual time.
func TestDrainClosesItsLimiters(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		mw, err := FromRules(parseRules(t, exportsRule(1)), rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		lim := mw.ruleNamed("exports").Limiter.(*throttle.Limiter)
		user, err := throttle.New(rdb, throttle.Options{}, throttle.Rule{Name: "mine", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(10)})
		if err != nil {
			t.Fatal(err)
		}
		userMW := middleware(t, []TaskRule{{Name: "mine", Tasks: []string{"mine"}, Limiter: user, Subject: Fixed("s")}}, Options{Logger: quiet})

		release := make(chan struct{})
		done := holding(mw, release)
		synctest.Wait()
		if len(redistest.LimiterGoroutines()) == 0 {
			t.Fatal("no renewal goroutine while a place is held: the check sees nothing")
		}
		mw.Drain()
		userMW.Drain()
		time.Sleep(3 * time.Second) // three leases: the place lives only if renewed
		if closedLimiter(t, lim) {
			t.Fatal("Drain closed the limiter while a task still held its place")
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatalf("the task holding a place: %v", err)
		}
		time.Sleep(10 * time.Second) // past every timer and lease
		synctest.Wait()
		if g := redistest.LimiterGoroutines(); len(g) > 0 {
			t.Fatalf("%d goroutines of the worker's limiters after Drain:\n%s", len(g), strings.Join(g, "\n\n"))
		}
		if !closedLimiter(t, lim) {
			t.Error("the limiter FromRules built is not closed after Drain and its last task")
		}
		err = mw.Wrap(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })).ProcessTask(context.Background(), asynq.NewTask("export", nil))
		if te := (*admission.ThrottledError)(nil); !errors.As(err, &te) || !errors.Is(err, ErrDraining) {
			t.Errorf("a task after Drain: %v, want a *admission.ThrottledError for ErrDraining", err)
		}
		if res, err := user.Allow(context.Background(), "s"); err != nil || !res.Allowed {
			t.Errorf("the caller's limiter after Drain: Allow = %+v, %v; want allowed", res, err)
		}
	})
}

// TestReloadClosesReplacedLimiters: Reload closes each limiter it replaced
// once the last task admitted under it returns (its place renewed until
// then), and leaves the new ones open.
func TestReloadClosesReplacedLimiters(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		mw, err := FromRules(parseRules(t, exportsRule(1)), rdb, Options{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer mw.Close()
		old := mw.ruleNamed("exports").Limiter.(*throttle.Limiter)
		release := make(chan struct{})
		done := holding(mw, release)
		if err := mw.Reload(parseRules(t, exportsRule(2))); err != nil {
			t.Fatalf("Reload: %v", err)
		}
		fresh := mw.ruleNamed("exports").Limiter.(*throttle.Limiter)
		time.Sleep(3 * time.Second)
		if closedLimiter(t, old) {
			t.Fatal("Reload closed the old limiter while a task admitted under it still ran")
		}
		close(release)
		if err := <-done; err != nil {
			t.Fatalf("the task holding a place: %v", err)
		}
		if !closedLimiter(t, old) {
			t.Error("the replaced limiter is not closed after its last task returned")
		}
		if closedLimiter(t, fresh) {
			t.Error("the new limiter is closed")
		}
		if ran, deferred := tally(t, mw, "export", 1, nil); ran != 1 || deferred != 0 {
			t.Errorf("a task after Reload: %d ran, %d deferred; want 1, 0", ran, deferred)
		}
	})
}
