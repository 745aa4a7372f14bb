package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"
)

var (
	// ErrExceedsCapacity is matched (errors.Is) by the error for a request
	// of more permits than a rule can ever admit at once; its message
	// names the rule, the request and the capacity.
	ErrExceedsCapacity = errors.New("throttle: request exceeds the limit's capacity")
	// ErrInvalidSubject is matched by errors for an empty or too long subject.
	ErrInvalidSubject = errors.New("throttle: invalid subject")
	// ErrRedis is matched by errors from talking to Redis; the underlying
	// error is wrapped too.
	ErrRedis = errors.New("throttle: redis")
)

// ConfigError reports an invalid rule or limiter option. Rule is empty for
// limiter-wide options.
type ConfigError struct {
	Rule   string // rule name, if known
	Field  string // count, period, burst, precision, name, algorithm, prefix, …
	Reason string // what is wrong and what is allowed
}

// Error names the rule (if any) and the field, and says what is allowed.
func (e *ConfigError) Error() string {
	if e.Rule == "" {
		return fmt.Sprintf("throttle: %s: %s", e.Field, e.Reason)
	}
	return fmt.Sprintf("throttle: rule %q: %s: %s", e.Rule, e.Field, e.Reason)
}

// capacityError is the error for a request of n permits that rule r can
// never admit at once (it admits at most c).
func capacityError(r string, n, c int) error {
	return fmt.Errorf("%w: rule %q: %d permits requested, but it admits at most %d at once; split the request or raise the limit", ErrExceedsCapacity, r, n, c)
}

// DelayError reports that a request would be admitted only after the
// caller's deadline or the limiter's MaxWait. Nothing was consumed.
// It matches context.DeadlineExceeded when the context's deadline was the
// bound (Deadline); otherwise the bound was the limiter's MaxWait.
type DelayError struct {
	Rule       string        // the rule that needs the longest wait
	RetryAfter time.Duration // how long from the decision until a request of this size would be admitted
	Deadline   bool          // the context's deadline was the bound (else MaxWait)
}

// Error says when the request would be admitted and which bound it passes.
func (e *DelayError) Error() string {
	bound := "the limiter's MaxWait"
	if e.Deadline {
		bound = "the context deadline"
	}
	return fmt.Sprintf("throttle: rule %q: admission in %v is past %s", e.Rule, e.RetryAfter, bound)
}

// Is matches context.DeadlineExceeded when the context's deadline bounded
// the wait.
func (e *DelayError) Is(target error) bool {
	return e.Deadline && target == context.DeadlineExceeded
}

// redisError wraps an error from Redis so that it matches ErrRedis and
// still unwraps to the cause.
type redisError struct {
	op  op
	err error
}

func (e *redisError) Error() string   { return fmt.Sprintf("throttle: redis %s: %v", e.op, e.err) }
func (e *redisError) Unwrap() []error { return []error{ErrRedis, e.err} }
