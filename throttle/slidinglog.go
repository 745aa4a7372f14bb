package throttle

import "fmt"

// SlidingLog: lua/slidinglog.lua keeps every permit, past and booked, in a
// sorted set, so its count is bounded.
var _ = register(SlidingLog, &algorithm{
	rank:  2,
	files: []string{"slidinglog.lua"},
	validate: func(r Rule) error {
		if r.Limit.Count > maxLogCount {
			return &ConfigError{Rule: r.Name, Field: "count", Reason: fmt.Sprintf("%v must be at most %d for sliding_log, which stores every permit; use sliding_window", r.Limit.Count, maxLogCount)}
		}
		return nil
	},
})
