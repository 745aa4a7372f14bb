package throttle

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

func mustZone(t testing.TB, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatalf("LoadLocation(%q): %v", name, err)
	}
	return loc
}

// Windows follow the zone's calendar: days of 23 and 25 hours where
// daylight saving starts and ends, months of 28 to 31 days, weeks from
// their first weekday.
func TestCalendarWindows(t *testing.T) {
	la := mustZone(t, "America/Los_Angeles")
	berlin := mustZone(t, "Europe/Berlin")
	cases := []struct {
		name       string
		cal        Calendar
		at         time.Time
		start, end time.Time
	}{
		{"day", Daily(la), time.Date(2025, 6, 3, 15, 0, 0, 0, la), time.Date(2025, 6, 3, 0, 0, 0, 0, la), time.Date(2025, 6, 4, 0, 0, 0, 0, la)},
		{"spring forward, 23h", Daily(la), time.Date(2025, 3, 9, 12, 0, 0, 0, la), time.Date(2025, 3, 9, 0, 0, 0, 0, la), time.Date(2025, 3, 10, 0, 0, 0, 0, la)},
		{"fall back, 25h", Daily(la), time.Date(2025, 11, 2, 1, 30, 0, 0, la), time.Date(2025, 11, 2, 0, 0, 0, 0, la), time.Date(2025, 11, 3, 0, 0, 0, 0, la)},
		{"midnight belongs to its day", Daily(nil), time.Date(2025, 1, 2, 0, 0, 0, 0, time.UTC), time.Date(2025, 1, 2, 0, 0, 0, 0, time.UTC), time.Date(2025, 1, 3, 0, 0, 0, 0, time.UTC)},
		{"ISO week", Weekly(berlin, time.Monday), time.Date(2025, 3, 30, 23, 0, 0, 0, berlin), time.Date(2025, 3, 24, 0, 0, 0, 0, berlin), time.Date(2025, 3, 31, 0, 0, 0, 0, berlin)},
		{"week from Sunday", Weekly(nil, time.Sunday), time.Date(2025, 3, 30, 0, 0, 0, 0, time.UTC), time.Date(2025, 3, 30, 0, 0, 0, 0, time.UTC), time.Date(2025, 4, 6, 0, 0, 0, 0, time.UTC)},
		{"February", Monthly(nil), time.Date(2025, 2, 28, 23, 59, 59, 0, time.UTC), time.Date(2025, 2, 1, 0, 0, 0, 0, time.UTC), time.Date(2025, 3, 1, 0, 0, 0, 0, time.UTC)},
		{"leap February", Monthly(nil), time.Date(2024, 2, 29, 12, 0, 0, 0, time.UTC), time.Date(2024, 2, 1, 0, 0, 0, 0, time.UTC), time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC)},
		{"December", Monthly(la), time.Date(2025, 12, 31, 23, 0, 0, 0, la), time.Date(2025, 12, 1, 0, 0, 0, 0, la), time.Date(2026, 1, 1, 0, 0, 0, 0, la)},
		{"month across a change", Monthly(la), time.Date(2025, 3, 15, 0, 0, 0, 0, la), time.Date(2025, 3, 1, 0, 0, 0, 0, la), time.Date(2025, 4, 1, 0, 0, 0, 0, la)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			start, end := c.cal.Window(c.at)
			if !start.Equal(c.start) || !end.Equal(c.end) {
				t.Errorf("Window(%v) = [%v, %v); want [%v, %v)", c.at, start, end, c.start, c.end)
			}
		})
	}
	lengths := []struct {
		cal  Calendar
		at   time.Time
		want time.Duration
	}{
		{Daily(la), time.Date(2025, 3, 9, 5, 0, 0, 0, la), 23 * time.Hour},
		{Daily(la), time.Date(2025, 11, 2, 5, 0, 0, 0, la), 25 * time.Hour},
		{Monthly(nil), time.Date(2025, 2, 10, 0, 0, 0, 0, time.UTC), 28 * 24 * time.Hour},
		{Monthly(nil), time.Date(2025, 1, 10, 0, 0, 0, 0, time.UTC), 31 * 24 * time.Hour},
		{Monthly(la), time.Date(2025, 3, 10, 0, 0, 0, 0, la), 31*24*time.Hour - time.Hour},
		{Weekly(la, time.Monday), time.Date(2025, 10, 30, 0, 0, 0, 0, la), 7*24*time.Hour + time.Hour},
	}
	for _, c := range lengths {
		if start, end := c.cal.Window(c.at); end.Sub(start) != c.want {
			t.Errorf("%v at %v: a window of %v, want %v", c.cal, c.at, end.Sub(start), c.want)
		}
	}
}

// In a zone whose midnight falls in the daylight-saving gap (Havana: 0:00
// became 1:00 on 2024-03-10), every instant is in exactly one window, the
// windows tile the time line, and that day starts at the jump.
func TestCalendarWindowsTileAGap(t *testing.T) {
	havana := mustZone(t, "America/Havana")
	cal := Daily(havana)
	t0 := time.Date(2024, 3, 8, 12, 0, 0, 0, time.UTC)
	_, end := cal.Window(t0)
	for at := t0; at.Before(t0.Add(96 * time.Hour)); at = at.Add(15 * time.Minute) {
		start, e := cal.Window(at)
		if at.Before(start) || !at.Before(e) {
			t.Fatalf("Window(%v) = [%v, %v): does not hold it", at, start, e)
		}
		if at.Before(end) {
			continue // still the window before
		}
		if !start.Equal(end) {
			t.Fatalf("Window(%v) starts at %v; the window before ended at %v", at, start, end)
		}
		end = e
	}
	start, end := cal.Window(time.Date(2024, 3, 10, 12, 0, 0, 0, havana))
	if want := time.Date(2024, 3, 10, 5, 0, 0, 0, time.UTC); !start.Equal(want) || end.Sub(start) != 23*time.Hour {
		t.Errorf("2024-03-10 in Havana: [%v, %v); want from %v (the jump), 23h", start, end, want)
	}
}

// sleepUntil moves the bubble's clock (and miniredis's TIME) to at, at
// most two years on: each simulated year costs real time.
func sleepUntil(t *testing.T, at time.Time) {
	t.Helper()
	if d := time.Until(at); d < 0 || d > 2*365*24*time.Hour {
		t.Fatalf("sleepUntil(%v): already %v", at, time.Now())
	} else {
		time.Sleep(d)
	}
}

// A daily quota resets at midnight in its zone, also on the days of 23 and
// 25 hours: ResetAfter and RetryAfter name that midnight on the Redis clock.
func TestCalendarDailyQuotaAcrossDST(t *testing.T) {
	la := mustZone(t, "America/Los_Angeles")
	for _, day := range []struct {
		name   string
		date   time.Time // midnight starting the day
		length time.Duration
	}{
		{"spring forward", time.Date(2000, 4, 2, 0, 0, 0, 0, la), 23 * time.Hour},
		{"fall back", time.Date(2000, 10, 29, 0, 0, 0, 0, la), 25 * time.Hour},
		{"ordinary", time.Date(2000, 6, 3, 0, 0, 0, 0, la), 24 * time.Hour},
	} {
		t.Run(day.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
				l := mustNew(t, rdb, Options{}, Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: 3}, Calendar: Daily(la)})
				sleepUntil(t, day.date.Add(-time.Minute)) // in 2000, where the bubble starts: short sleeps
				if got := admitted(t, l, "acct", 5); got != 3 {
					t.Fatalf("the evening before: %d admitted, want 3", got)
				}
				res := allow(t, l, "acct", 1)
				if res.Allowed || res.RetryAfter != time.Minute {
					t.Fatalf("over the quota: %+v; want denied, RetryAfter 1m (midnight)", res)
				}
				sleepUntil(t, day.date)
				res = allow(t, l, "acct", 1)
				if !res.Allowed || res.Remaining != 2 || res.ResetAfter != day.length {
					t.Fatalf("at midnight: %+v; want allowed, 2 remaining, ResetAfter %v", res, day.length)
				}
				if got := admitted(t, l, "acct", 5); got != 2 {
					t.Fatalf("the rest of the day: %d admitted, want 2", got)
				}
				sleepUntil(t, day.date.Add(day.length-time.Second))
				if res := allow(t, l, "acct", 1); res.Allowed || res.RetryAfter != time.Second {
					t.Fatalf("a second before the next midnight: %+v; want denied for 1s", res)
				}
				sleepUntil(t, day.date.Add(day.length))
				if got := admitted(t, l, "acct", 5); got != 3 {
					t.Fatalf("the next day: %d admitted, want 3", got)
				}
			})
		})
	}
}

// A monthly quota resets on the first, however long the month. (The
// bubble's clock starts in 2000: its dates keep the sleeps short.)
func TestCalendarMonthlyQuota(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "monthly", Algorithm: CalendarWindow, Limit: Limit{Count: 10}, Calendar: Monthly(nil)})
		for _, m := range []struct {
			first time.Time
			days  int
		}{
			{time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC), 31},
			{time.Date(2000, 2, 1, 0, 0, 0, 0, time.UTC), 29},
			{time.Date(2000, 4, 1, 0, 0, 0, 0, time.UTC), 30},
			{time.Date(2001, 2, 1, 0, 0, 0, 0, time.UTC), 28},
		} {
			sleepUntil(t, m.first)
			res := allow(t, l, "acct", 4)
			if want := time.Duration(m.days) * 24 * time.Hour; !res.Allowed || res.ResetAfter != want {
				t.Fatalf("%v: %+v; want allowed, ResetAfter %v", m.first, res, want)
			}
			sleepUntil(t, m.first.AddDate(0, 1, 0).Add(-time.Second))
			if got := admitted(t, l, "acct", 10); got != 6 {
				t.Fatalf("the month's last second: %d admitted, want 6", got)
			}
		}
	})
}

// Across a midnight, under callers that Allow, Reserve ahead and Wait at
// random moments, no calendar day admits more than its quota on the Redis
// clock.
func TestCalendarQuotaNeverExceeded(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		const quota = 7
		la := mustZone(t, "America/Los_Angeles")
		l := mustNew(t, rdb, Options{MaxWait: 2 * time.Hour}, Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: quota}, Calendar: Daily(la)})
		midnight := time.Date(2000, 4, 2, 0, 0, 0, 0, la)
		sleepUntil(t, midnight.Add(-10*time.Minute))
		perDay := map[string]int{}
		ctx := context.Background()
		for i := range 60 {
			switch i % 3 {
			case 0:
				if allow(t, l, "acct", 1).Allowed {
					perDay[time.Now().In(la).Format(time.DateOnly)]++
				}
			case 1:
				r, err := l.ReserveN(ctx, "acct", 1)
				if err == nil {
					perDay[time.Now().Add(r.Delay()).In(la).Format(time.DateOnly)]++
				}
			default:
				wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				if l.Wait(wctx, "acct") == nil {
					perDay[time.Now().In(la).Format(time.DateOnly)]++
				}
				cancel()
			}
			time.Sleep(time.Duration(7+i%5) * time.Second)
		}
		for day, n := range perDay {
			if n > quota {
				t.Errorf("%s: %d admitted, more than the quota %d", day, n, quota)
			}
		}
		if perDay["2000-04-01"] != quota || perDay["2000-04-02"] != quota {
			t.Errorf("admitted per day %v; want %d on each side of midnight", perDay, quota)
		}
	})
}

// A calendar quota beside a per-second limit, in one policy: both hold,
// decided in one call, and a request either denies charges neither.
func TestCalendarBesidePerSecond(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		sleepUntil(t, time.Date(2000, 6, 3, 23, 59, 57, 0, time.UTC))
		l := mustNew(t, rdb, Options{},
			Rule{Name: "second", Algorithm: GCRA, Limit: PerSecond(2)},
			Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: 5}, Calendar: Daily(nil)},
		)
		calls := countScripts(rdb)
		var got []string
		for range 4 { // 23:59:57 .. 00:00:00
			n := admitted(t, l, "acct", 3)
			got = append(got, fmt.Sprint(n))
			res := allow(t, l, "acct", 1)
			got = append(got, res.Rule)
			time.Sleep(time.Second)
		}
		if want := "2 second 2 second 1 daily 2 second"; fmt.Sprint(got) != "["+want+"]" {
			t.Errorf("admitted and deciding rule per second: %v; want [%s]", got, want)
		}
		if c := calls.Load(); c != 16 {
			t.Errorf("%d script calls for 16 decisions; want one each", c)
		}
	})
}

// A process whose estimate of Redis TIME is a day off (Redis's clock
// stepped) asks once more with the right windows, and charges once.
func TestCalendarClockStep(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		l := mustNew(t, rdb, Options{}, Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: 2}, Calendar: Daily(nil)})
		allow(t, l, "warm", 1) // the estimate is learnt from this reply
		m.SetTime(time.Now().Add(50 * time.Hour))
		calls := countScripts(rdb)
		if res := allow(t, l, "acct", 1); !res.Allowed || res.Remaining != 1 {
			t.Fatalf("after the step: %+v; want allowed, 1 remaining", res)
		}
		if c := calls.Load(); c != 2 {
			t.Errorf("%d script calls; want 2 (one answered with stale windows)", c)
		}
		if res := allow(t, l, "acct", 1); !res.Allowed || res.Remaining != 0 {
			t.Fatalf("the next call: %+v; want allowed, 0 remaining", res)
		}
		if c := calls.Load(); c != 3 {
			t.Errorf("%d script calls; want 3: the estimate follows the step", c)
		}
	})
}

// Reserve books a request that does not fit today into tomorrow's window,
// and Cancel gives it back.
func TestCalendarReserveAhead(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		sleepUntil(t, time.Date(2000, 6, 3, 23, 59, 30, 0, time.UTC))
		l := mustNew(t, rdb, Options{}, Rule{Name: "daily", Algorithm: CalendarWindow, Limit: Limit{Count: 2}, Calendar: Daily(nil)})
		ctx := context.Background()
		admitted(t, l, "acct", 2)
		r, err := l.ReserveN(ctx, "acct", 2)
		if err != nil || r.Delay() != 30*time.Second {
			t.Fatalf("ReserveN: %v, %v; want a slot at midnight, in 30s", r, err)
		}
		if _, err := l.ReserveN(ctx, "acct", 1); err == nil {
			t.Fatal("a third window is not known: ReserveN must fail")
		} else if de := new(DelayError); !errors.As(err, &de) {
			t.Fatalf("ReserveN: %v; want a *DelayError", err)
		}
		r.Cancel(ctx)
		sleepUntil(t, time.Date(2000, 6, 4, 0, 0, 0, 0, time.UTC))
		if got := admitted(t, l, "acct", 3); got != 2 {
			t.Fatalf("after the cancel: %d admitted tomorrow, want 2", got)
		}
	})
}

// Rule.Validate names what is wrong with a calendar rule.
func TestCalendarValidate(t *testing.T) {
	cases := []struct {
		name  string
		rule  Rule
		field string
	}{
		{"no calendar", Rule{Name: "q", Algorithm: CalendarWindow, Limit: Limit{Count: 5}}, "calendar"},
		{"a period of its own", Rule{Name: "q", Algorithm: CalendarWindow, Limit: Limit{Count: 5, Period: time.Hour}, Calendar: Daily(nil)}, "period"},
		{"a calendar on a fixed window", Rule{Name: "q", Algorithm: FixedWindow, Limit: PerSecond(5), Calendar: Daily(nil)}, "calendar"},
		{"no count", Rule{Name: "q", Algorithm: CalendarWindow, Calendar: Monthly(nil)}, "count"},
		{"a bad weekday", Rule{Name: "q", Algorithm: CalendarWindow, Limit: Limit{Count: 5}, Calendar: Weekly(nil, 9)}, "calendar"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var ce *ConfigError
			if err := c.rule.Validate(); !errors.As(err, &ce) || ce.Field != c.field {
				t.Errorf("Validate() = %v; want a *ConfigError of field %q", err, c.field)
			}
		})
	}
	ok := Rule{Name: "q", Algorithm: CalendarWindow, Limit: Limit{Count: 5}, Calendar: Weekly(nil, time.Monday)}
	if err := ok.Validate(); err != nil {
		t.Errorf("Validate(%v) = %v", ok, err)
	}
}

// ParseCalendar reads what rules files write, and says what to write
// instead of what it cannot read.
func TestParseCalendar(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"day@America/Los_Angeles", "day@America/Los_Angeles"},
		{"Month@UTC", "month@UTC"},
		{"week@Europe/Berlin", "week@Europe/Berlin"},
		{"week(sunday)@UTC", "week(sunday)@UTC"},
		{"week(Monday)@UTC", "week@UTC"},
	} {
		cal, err := ParseCalendar(c.in)
		if err != nil || cal.String() != c.want {
			t.Errorf("ParseCalendar(%q) = %v, %v; want %s", c.in, cal, err, c.want)
		}
	}
	for _, c := range []struct{ in, says string }{
		{"day", "names no time zone"},
		{"day@", "names no time zone"},
		{"day@Mars/Olympus", `unknown time zone "Mars/Olympus"`},
		{"day@Local", "Local is each machine's own zone"},
		{"fortnight@UTC", `unknown unit "fortnight"`},
		{"day(sunday)@UTC", `unknown unit "day(sunday)"`},
		{"week(someday)@UTC", `"someday" is not a weekday`},
	} {
		if _, err := ParseCalendar(c.in); err == nil || !strings.Contains(err.Error(), c.says) || !strings.HasPrefix(err.Error(), "throttle: ") {
			t.Errorf("ParseCalendar(%q) = %v; want an error saying %q", c.in, err, c.says)
		}
	}
}
