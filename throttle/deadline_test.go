package throttle

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A call cut short by the caller's deadline reports the deadline, even when
// the connection's read timeout fired an instant before the context did.
func TestDeadlineCause(t *testing.T) {
	timeout := errors.New("read tcp 127.0.0.1:6379: i/o timeout")
	past, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
	defer cancel()
	future, cancel2 := context.WithTimeout(context.Background(), time.Hour)
	defer cancel2()

	if err := deadlineCause(past, timeout); !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, timeout) {
		t.Errorf("deadline passed: %v, want both the deadline and the cause", err)
	}
	if err := deadlineCause(future, timeout); err != timeout {
		t.Errorf("deadline ahead: %v, want the cause alone", err)
	}
	if err := deadlineCause(context.Background(), timeout); err != timeout {
		t.Errorf("no deadline: %v, want the cause alone", err)
	}
	if err := deadlineCause(past, context.Canceled); err != context.Canceled {
		t.Errorf("a context error: %v, want it as it is", err)
	}
	// Through the runner: a *redisError that matches ErrRedis and the
	// deadline.
	var r runner
	if err := r.result(past, opAllow, timeout); !errors.Is(err, ErrRedis) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("result: %v, want ErrRedis and the deadline", err)
	}
}
