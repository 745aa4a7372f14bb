package throttle

import (
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// calendarStamp writes the windows of a limiter's CalendarWindow rules into
// each of its deciding calls (allow, reserve, atmost, prepay, admit), just
// before the call is sent (lua/calendar.lua reads them), and learns Redis
// TIME from the replies, so that the windows it sends are those around
// Redis's clock, not this process's.
//
// The estimate of Redis TIME is the latest reply's Redis now plus the
// local (monotonic) time since it came back: never ahead of Redis by more
// than the clocks' drift, since Redis read its TIME before the reply left.
// Before the first reply, the local wall clock stands in.
type calendarStamp struct {
	rules []calendarRule

	mu       sync.Mutex
	recv     time.Time // when the reply carrying redisNow came back (local, monotonic)
	redisNow int64     // µs of Redis TIME in that reply; recv is zero before one
}

// calendarRule is a CalendarWindow rule of a policy: its index and calendar.
type calendarRule struct {
	i   int
	cal Calendar
}

// newCalendarStamp returns the stamp of rules' CalendarWindow rules, nil if
// there is none.
func newCalendarStamp(rules []Rule) *calendarStamp {
	var s calendarStamp
	for i, r := range rules {
		if r.Algorithm == CalendarWindow {
			s.rules = append(s.rules, calendarRule{i: i, cal: r.Calendar})
		}
	}
	if s.rules == nil {
		return nil
	}
	return &s
}

// deciding reports whether line is a call of a policy script that decides
// with the rules' windows (ARGV[1], lua/rules.lua) and carries them.
func (s *calendarStamp) deciding(line []any) bool {
	if s == nil {
		return false
	}
	_, args := lineArgs(line)
	if len(args) < 3 {
		return false
	}
	switch args[0] {
	case "allow", "reserve", string(opAtMost), string(opPrepay), string(opAdmit):
	default:
		return false
	}
	last := s.rules[len(s.rules)-1].i
	return len(args) > 3+5*last+4 && args[3+5*last] == string(CalendarWindow)
}

// estimate is this process's estimate of Redis TIME now.
func (s *calendarStamp) estimate() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recv.IsZero() {
		return time.Now()
	}
	return time.UnixMicro(s.redisNow).Add(time.Since(s.recv))
}

// stamp writes into line, a deciding call, each calendar rule's windows
// around t: period (the window's length), extra (its end) and, in the
// ticket's place, the next window's end, all in µs of Redis time.
func (s *calendarStamp) stamp(line []any, t time.Time) {
	_, args := lineArgs(line)
	for _, r := range s.rules {
		start, end := r.cal.Window(t)
		next := r.cal.after(end)
		b := 3 + 5*r.i
		args[b+2], args[b+3], args[b+4] = end.Sub(start).Microseconds(), end.UnixMicro(), next.UnixMicro()
	}
}

// learn reads Redis now from cmd, the reply to line, a deciding call, and
// reports whether it fell outside the windows line carried: the call was
// answered "not now" without charging anything, and may be asked again.
func (s *calendarStamp) learn(line []any, cmd *redis.Cmd) (stale bool) {
	raw, ok := cmd.Val().([]any)
	if cmd.Err() != nil || !ok || len(raw) < 6 {
		return false
	}
	now, ok := raw[5].(int64)
	if !ok {
		return false
	}
	s.mu.Lock()
	s.recv, s.redisNow = time.Now(), now
	s.mu.Unlock()
	_, args := lineArgs(line)
	for _, r := range s.rules {
		b := 3 + 5*r.i
		length, end, next := args[b+2].(int64), args[b+3].(int64), args[b+4].(int64)
		if now < end-length || now >= next {
			return true
		}
	}
	return false
}

// resendable reports whether a deciding call answered stale may be sent again:
// every operation but admit, whose "not now" may have put its caller in a
// line (lua/admit.lua), which a second call must not repeat.
func resendable(line []any) bool {
	_, args := lineArgs(line)
	return args[0] != string(opAdmit)
}
