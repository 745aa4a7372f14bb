package worker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

func TestIsFailure(t *testing.T) {
	te := &admission.ThrottledError{Rule: "r", Subject: "s", RetryAt: time.Unix(100, 0)}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"throttled", te, false},
		{"wrapped throttled", fmt.Errorf("handler: %w", te), false},
		{"requeued", revokedError{&admission.ThrottledError{Requeued: "x~throttled1"}}, false},
		{"plain", errors.New("boom"), true},
		{"delay error alone", &throttle.DelayError{Rule: "r", RetryAfter: time.Second}, true},
		{"skip retry", fmt.Errorf("bad: %w", asynq.SkipRetry), true},
		{"context canceled", context.Canceled, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := IsFailure(tc.err); got != tc.want {
				t.Errorf("IsFailure(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

func TestDelayUntil(t *testing.T) {
	base := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		now, at time.Time
		want    time.Duration
	}{
		{"mid-second rounds up", base.Add(100 * time.Millisecond), base.Add(2300 * time.Millisecond), 2900 * time.Millisecond},
		{"whole second stays", base.Add(250 * time.Millisecond), base.Add(3 * time.Second), 2750 * time.Millisecond},
		{"past is next second", base.Add(400 * time.Millisecond), base.Add(-time.Hour), 600 * time.Millisecond},
		{"now at a whole second waits the minimum, rounded", base, base, time.Second},
		{"just before a second", base.Add(998 * time.Millisecond), base.Add(999600 * time.Microsecond), 2 * time.Millisecond},
		{"minimum crosses a second", base.Add(999500 * time.Microsecond), base.Add(999600 * time.Microsecond), 1000500 * time.Microsecond},
		{"far future", base, base.Add(90*time.Minute + time.Nanosecond), 90*time.Minute + time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := delayUntil(tc.now, tc.at)
			if got != tc.want {
				t.Errorf("delayUntil(now, at) = %v, want %v", got, tc.want)
			}
			// What asynq does with it: score = (now+d).Unix(); the forwarder
			// releases the task once the Unix second reaches the score.
			score := tc.now.Add(got).Unix()
			if release := time.Unix(score, 0); release.Before(tc.at) || release.Before(tc.now) {
				t.Errorf("released at %v, before RetryAt %v or now %v", release, tc.at, tc.now)
			}
			if got < minRetryDelay {
				t.Errorf("delay %v below the minimum %v", got, minRetryDelay)
			}
		})
	}
}

func TestRetryDelay(t *testing.T) {
	task := asynq.NewTask("t", nil)
	fallback := func(n int, err error, _ *asynq.Task) time.Duration { return time.Duration(n) * time.Minute }

	f := RetryDelay(fallback)
	if got := f(3, errors.New("boom"), task); got != 3*time.Minute {
		t.Errorf("other error: got %v, want the fallback's 3m", got)
	}
	at := time.Now().Add(4200 * time.Millisecond)
	got := f(7, fmt.Errorf("wrapped: %w", &admission.ThrottledError{RetryAt: at}), task)
	if got < time.Until(at) || got > time.Until(at)+time.Second {
		t.Errorf("throttled: got %v, want RetryAt (in %v) rounded up to a whole second", got, time.Until(at))
	}

	def := RetryDelay(nil)
	if got, lo := def(1, errors.New("boom"), task), time.Second; got < lo {
		t.Errorf("nil fallback: got %v, want asynq.DefaultRetryDelayFunc's (at least %v)", got, lo)
	}
}

func TestConfigure(t *testing.T) {
	te := &admission.ThrottledError{RetryAt: time.Now().Add(time.Minute)}
	notFailure := errors.New("not a failure to me")
	c := Configure(asynq.Config{
		IsFailure:      func(err error) bool { return !errors.Is(err, notFailure) },
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 42 * time.Second },
	})
	if c.IsFailure(te) || c.IsFailure(notFailure) || !c.IsFailure(errors.New("x")) {
		t.Error("IsFailure must be false for throttled errors and defer to the config's own for others")
	}
	if d := c.RetryDelayFunc(0, errors.New("x"), nil); d != 42*time.Second {
		t.Errorf("RetryDelayFunc(other) = %v, want the config's own 42s", d)
	}
	if d := c.RetryDelayFunc(0, te, nil); d < 59*time.Second || d > 61*time.Second {
		t.Errorf("RetryDelayFunc(throttled) = %v, want about 1m", d)
	}
	if c.DelayedTaskCheckInterval != CheckInterval || c.TaskCheckInterval != CheckInterval {
		t.Errorf("DelayedTaskCheckInterval = %v, TaskCheckInterval = %v; want both %v", c.DelayedTaskCheckInterval, c.TaskCheckInterval, CheckInterval)
	}
	c = Configure(asynq.Config{DelayedTaskCheckInterval: 3 * time.Second, TaskCheckInterval: 2 * time.Second})
	if c.DelayedTaskCheckInterval != 3*time.Second || c.TaskCheckInterval != 2*time.Second || !c.IsFailure(errors.New("x")) {
		t.Error("Configure must keep set intervals and count other errors as failures by default")
	}
}

func TestThrottledError(t *testing.T) {
	cause := &throttle.DelayError{Rule: "stripe", RetryAfter: 4 * time.Second}
	te := &admission.ThrottledError{Rule: "stripe", Subject: "acct_42", RetryAt: time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC), Err: cause}
	want := `admission: waiting, not failed: rule "stripe", subject "acct_42", runs again at 2026-05-06T07:08:09Z: throttle: rule "stripe": admission in 4s is past the limiter's MaxWait`
	if got := te.Error(); got != want {
		t.Errorf("Error() =\n%s\nwant\n%s", got, want)
	}
	if !isMaxWaitBound(te) || errors.Is(te, asynq.RevokeTask) {
		t.Error("a deferred task's error must unwrap to its cause and not revoke the task")
	}
	te.Requeued = "abc~throttled1"
	var got *admission.ThrottledError
	if err := error(revokedError{te}); !errors.Is(err, asynq.RevokeTask) || !errors.As(err, &got) || got != te || !strings.Contains(err.Error(), "requeued as task abc~throttled1") {
		t.Errorf("a requeued task's error must match asynq.RevokeTask and its *ThrottledError, and name the copy: %v", err)
	}
}

func TestNextCopyID(t *testing.T) {
	for id, want := range map[string]string{
		"abc":                     "abc~throttled1",
		"abc~throttled1":          "abc~throttled2",
		"abc~throttled41":         "abc~throttled42",
		"abc~throttled":           "abc~throttled~throttled1",
		"abc~throttled-1":         "abc~throttled-1~throttled1",
		"abc~throttledx":          "abc~throttledx~throttled1",
		"a~throttled1b":           "a~throttled1b~throttled1",
		"":                        "~throttled1",
		"x~throttled1~throttled9": "x~throttled1~throttled10",
	} {
		if got := nextCopyID(id); got != want {
			t.Errorf("nextCopyID(%q) = %q, want %q", id, got, want)
		}
	}
}

// isMaxWaitBound reports whether err holds a *throttle.DelayError whose
// bound was a limiter's MaxWait or a rule's max_wait, not a context
// deadline.
func isMaxWaitBound(err error) bool {
	var de *throttle.DelayError
	return errors.As(err, &de) && !de.Deadline
}
