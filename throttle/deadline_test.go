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

// OnRedisError hears of a failed call unless the call's caller ended it: a
// cancelled context or a passed deadline of the caller's is not a Redis
// failure, the library's own time bound on a refund or a renewal is.
func TestCallerEndedNotReported(t *testing.T) {
	timeout := errors.New("read tcp 127.0.0.1:6379: i/o timeout")
	bg := context.Background()
	cancelled, cancel := context.WithCancel(bg)
	cancel()
	past, cancel := context.WithDeadline(bg, time.Now().Add(-time.Millisecond))
	defer cancel()
	future, cancel := context.WithTimeout(bg, time.Hour)
	defer cancel()
	own, cancel := ownTimeout(bg, -time.Millisecond) // fired
	defer cancel()
	<-own.Done()
	ownAhead, cancel := ownTimeout(bg, time.Hour)
	defer cancel()
	dl, _ := ownAhead.Deadline()
	ownInPast, cancel := ownTimeout(past, time.Hour) // the caller's earlier deadline is the one that passed
	defer cancel()
	ownDetached, cancel := ownTimeout(context.WithoutCancel(past), -time.Millisecond)
	defer cancel()
	<-ownDetached.Done()

	for _, c := range []struct {
		name   string
		ctx    context.Context
		report bool
	}{
		{"alive, no deadline", bg, true},
		{"deadline ahead", future, true},
		{"cancelled by the caller", cancelled, false},
		{"the caller's deadline passed", past, false},
		{"the library's bound fired", own, true},
		{"the caller's deadline under the library's bound", ownInPast, false},
		{"the library's bound on a detached context", ownDetached, true},
	} {
		var reported int
		r := runner{opts: Options{OnRedisError: func(error, bool) { reported++ }}}
		err := r.result(c.ctx, opRefund, timeout) // an operation that never fails open: result reports it
		if !errors.Is(err, ErrRedis) {
			t.Errorf("%s: %v, want ErrRedis", c.name, err)
		}
		if open := r.redisFailed(c.ctx, timeout); open {
			t.Errorf("%s: failed open without FailOpen", c.name)
		}
		reported /= 2 // redisFailed, the fail-open operations' path, reports the same way
		if got := reported == 1; got != c.report {
			t.Errorf("%s: reported %d times, want reported: %v", c.name, reported, c.report)
		}
	}
	// The instant the library's own deadline passes, before its timer
	// fires, counts as the library's: callerEnded compares the deadline
	// with the one ownTimeout kept.
	if v, _ := ownAhead.Value(ownDeadline{}).(time.Time); !v.Equal(dl) {
		t.Errorf("ownTimeout keeps %v, its context's deadline is %v", v, dl)
	}
}
