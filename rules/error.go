package rules

import "github.com/jobthrottle/jobthrottle/internal/yamlfile"

// Error reports an invalid line of one of jobthrottle's files: the rules
// file (Parse), its handlers section (package handler) or a schedules
// file (package enqueue). Its message names the file, the line, the entry
// and the field, and says what is allowed:
//
//	rules.yaml:7: rule "stripe": period: "0s" must be at least 1µs
//	schedules.yaml:14: schedule "heartbeat": pace.rate: rate "fast": write count/period, such as 20/s
type Error struct {
	File string
	Line int // 1-based; 0 if unknown
	// Kind and Name say which entry of the file the line belongs to: Kind
	// is "rule" or "schedule", Name its name, or "#n" (its 1-based
	// position) before its name is known. Both are "" for file-level
	// fields and for the handlers section, whose Field says where.
	Kind, Name string
	Field      string // such as "period", "limits[2].burst" or "handlers[1].http.url"; "" for the file as a whole
	Reason     string
}

// Error says file:line, the rule or schedule, the field and what to fix.
func (e *Error) Error() string {
	return yamlfile.Message(e.File, e.Line, e.Kind, e.Name, e.Field, e.Reason)
}
