package throttle

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// CalendarWindow: a fixed window aligned to the calendar of a time zone
// (Rule.Calendar): a day from midnight to midnight, a week from its first
// day, a month from the first. lua/calendar.lua keeps its state in the
// same fields as lua/fixedwindow.lua (w: the start of the window holding
// permits, c: its count, pu: a pause), so the fixed window's refund,
// settle and pause serve it unchanged.
var _ = register(CalendarWindow, &algorithm{
	rank:  7,
	files: []string{"fixedwindow.lua", "calendar.lua"},
	extra: func(Rule) int64 { return 0 }, // validateCalendar runs first, from Rule.Validate
})

// calendarUnit is the length of a calendar window: a day, a week or a
// month (Daily, Weekly, Monthly).
type calendarUnit int

// The calendar units.
const (
	// unitDay runs from midnight to midnight in the calendar's zone: 24
	// hours, or 23 and 25 on the days daylight-saving time starts and ends.
	unitDay calendarUnit = iota + 1
	// unitWeek runs from midnight of its first weekday (Calendar.WeekStart)
	// for seven days.
	unitWeek
	// unitMonth runs from midnight of its first day to midnight of the next
	// month's first: 28 to 31 days (and an hour more or less across a
	// daylight-saving change).
	unitMonth
)

// String is the unit as rules files write it: "day", "week", "month".
func (u calendarUnit) String() string {
	switch u {
	case unitDay:
		return "day"
	case unitWeek:
		return "week"
	case unitMonth:
		return "month"
	}
	return fmt.Sprintf("calendarUnit(%d)", int(u))
}

// nominal is the unit's usual length: 24h, 168h, and a month's longest,
// 744h (Calendar.Period).
func (u calendarUnit) nominal() time.Duration {
	switch u {
	case unitWeek:
		return 7 * 24 * time.Hour
	case unitMonth:
		return 31 * 24 * time.Hour
	}
	return 24 * time.Hour
}

// A Calendar places a CalendarWindow rule's windows on the wall clock of a
// time zone: a quota of 1000 a day that resets at midnight in Los Angeles,
// 50000 a month from the first, UTC. Build one with Daily, Weekly or
// Monthly; the zero Calendar is not valid.
//
// The windows are computed in Go (time.LoadLocation's rules, daylight
// saving included) and sent to the script with each call; Redis TIME stays
// the clock that picks among them (see CalendarWindow).
type Calendar struct {
	unit      calendarUnit
	loc       *time.Location
	weekStart time.Weekday
}

// Daily returns the calendar of days in loc (nil: UTC).
func Daily(loc *time.Location) Calendar { return Calendar{unit: unitDay, loc: loc} }

// Weekly returns the calendar of weeks in loc (nil: UTC) that start on
// first: time.Monday for ISO 8601 weeks (the rules file's default).
func Weekly(loc *time.Location, first time.Weekday) Calendar {
	return Calendar{unit: unitWeek, loc: loc, weekStart: first}
}

// Monthly returns the calendar of months in loc (nil: UTC).
func Monthly(loc *time.Location) Calendar { return Calendar{unit: unitMonth, loc: loc} }

// Unit is the calendar's unit as rules files write it: "day", "week" or
// "month"; empty for the zero Calendar.
func (c Calendar) Unit() string {
	if c.unit == 0 {
		return ""
	}
	return c.unit.String()
}

// Period is the period a CalendarWindow rule's Limit reports: the unit's
// usual length, 24h, 168h, and a month's longest, 744h; 0 for the zero
// Calendar. Only messages and the rough figures every rule has (a line's
// fallback wait, a batch's estimated span) use it; windows follow the
// calendar.
func (c Calendar) Period() time.Duration {
	if c.unit == 0 {
		return 0
	}
	return c.unit.nominal()
}

// Location is the calendar's time zone (UTC for nil).
func (c Calendar) Location() *time.Location {
	if c.loc == nil {
		return time.UTC
	}
	return c.loc
}

// WeekStart is the first day of a Week calendar's weeks.
func (c Calendar) WeekStart() time.Weekday { return c.weekStart }

// String describes the calendar as rules files write it: "day@UTC",
// "week@Europe/Berlin" (weeks from Monday), "week(sunday)@UTC".
func (c Calendar) String() string {
	u := c.unit.String()
	if c.unit == unitWeek && c.weekStart != time.Monday {
		u += "(" + lower(c.weekStart.String()) + ")"
	}
	return u + "@" + c.Location().String()
}

func lower(s string) string { return strings.ToLower(s) }

// Window returns the start and end of the window that holds t.
func (c Calendar) Window(t time.Time) (start, end time.Time) {
	y, m, d := t.In(c.Location()).Date()
	switch c.unit {
	case unitWeek:
		d -= (int(t.In(c.Location()).Weekday()) - int(c.weekStart) + 7) % 7
	case unitMonth:
		d = 1
	}
	start = c.midnight(y, m, d)
	return start, c.after(start)
}

// after returns the end of the window that starts at start: the next
// one's start.
func (c Calendar) after(start time.Time) time.Time {
	y, m, d := start.In(c.Location()).Date()
	switch c.unit {
	case unitWeek:
		d += 7
	case unitMonth:
		m++
	default:
		d++
	}
	return c.midnight(y, m, d)
}

// midnight returns the first instant of the local date y-m-d (normalized
// as time.Date does). Where daylight saving skips midnight (0:00 becomes
// 1:00), time.Date may place it before the jump, on the day before; the
// day then starts at the jump.
func (c Calendar) midnight(y int, m time.Month, d int) time.Time {
	t := time.Date(y, m, d, 0, 0, 0, 0, c.Location())
	want := time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	if ty, tm, td := t.Date(); time.Date(ty, tm, td, 0, 0, 0, 0, time.UTC).Before(want) {
		_, t = t.ZoneBounds()
	}
	return t
}

// validateCalendar checks a CalendarWindow rule's Calendar and Period.
func validateCalendar(r Rule) error {
	c := r.Calendar
	switch {
	case c.unit < unitDay || c.unit > unitMonth:
		return &ConfigError{Rule: r.Name, Field: "calendar", Reason: "is not set; build it with throttle.Daily, Weekly or Monthly"}
	case c.weekStart < time.Sunday || c.weekStart > time.Saturday:
		return &ConfigError{Rule: r.Name, Field: "calendar", Reason: fmt.Sprintf("week start %d is not a weekday", int(c.weekStart))}
	case r.Limit.Period != 0 && r.Limit.Period != c.unit.nominal():
		return &ConfigError{Rule: r.Name, Field: "period", Reason: fmt.Sprintf("%v: a calendar window's period is its Calendar's; leave Period zero", r.Limit.Period)}
	}
	return nil
}

// zones holds the zones ParseCalendar loaded, by name, so that a calendar
// read twice (a rules file reloaded) is == to itself: time.LoadLocation
// returns a new *time.Location each time.
var zones sync.Map

// loadZone is time.LoadLocation, once per name.
func loadZone(name string) (*time.Location, error) {
	if loc, ok := zones.Load(name); ok {
		return loc.(*time.Location), nil
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, err
	}
	actual, _ := zones.LoadOrStore(name, loc)
	return actual.(*time.Location), nil
}

// ParseCalendar reads a calendar as rules files write it: a unit, day,
// week or month, then @ and an IANA time zone: "day@America/Los_Angeles",
// "month@UTC". Weeks start on Monday (ISO 8601) unless the unit names
// another first day: "week(sunday)@UTC". The zone is required (a quota's
// midnight is somewhere), and Local is refused: the machines of a fleet
// may not share it. Zones are read with time.LoadLocation, from the
// system's zoneinfo or an embedded time/tzdata.
func ParseCalendar(s string) (Calendar, error) {
	unit, zone, ok := strings.Cut(strings.TrimSpace(s), "@")
	if !ok || zone == "" {
		return Calendar{}, fmt.Errorf("throttle: calendar %q names no time zone; write day@UTC, week@Europe/Berlin or month@America/Los_Angeles", s)
	}
	if zone == "Local" {
		return Calendar{}, fmt.Errorf("throttle: calendar %q: Local is each machine's own zone; name the zone, such as UTC or America/Los_Angeles", s)
	}
	loc, err := loadZone(zone)
	if err != nil {
		return Calendar{}, fmt.Errorf("throttle: calendar %q: unknown time zone %q; use an IANA name such as UTC, Europe/Berlin or America/Los_Angeles", s, zone)
	}
	unit, first, hasFirst := strings.Cut(strings.ToLower(unit), "(")
	switch {
	case unit == "day" && !hasFirst:
		return Daily(loc), nil
	case unit == "month" && !hasFirst:
		return Monthly(loc), nil
	case unit == "week" && !hasFirst:
		return Weekly(loc, time.Monday), nil
	case unit == "week" && strings.HasSuffix(first, ")"):
		for d := time.Sunday; d <= time.Saturday; d++ {
			if lower(d.String()) == strings.TrimSuffix(first, ")") {
				return Weekly(loc, d), nil
			}
		}
		return Calendar{}, fmt.Errorf("throttle: calendar %q: %q is not a weekday; write week(sunday), week(monday), …", s, strings.TrimSuffix(first, ")"))
	}
	return Calendar{}, fmt.Errorf("throttle: calendar %q: unknown unit %q; use day, week, week(sunday) or month", s, strings.SplitN(s, "@", 2)[0])
}
