package admission

import (
	"errors"
	"strconv"
	"strings"
	"time"
)

// ParseThrottledError reads back the text of a *ThrottledError (its
// Error), as a queue keeps it for a parked or deferred job (asynq's last
// error): the rule, the subject, RetryAt, Requeued, and the cause's text as
// Err (errors.New of it; nil if none). The result's Error is msg again. ok
// is false for any other text, such as a handler's failure.
func ParseThrottledError(msg string) (_ *ThrottledError, ok bool) {
	s, ok := strings.CutPrefix(msg, throttledLead)
	if !ok {
		return nil, false
	}
	te := &ThrottledError{}
	var err error
	if te.Rule, s, err = quoted(s, "rule "); err != nil {
		return nil, false
	}
	if te.Subject, s, err = quoted(s, ", subject "); err != nil {
		return nil, false
	}
	s, ok = strings.CutPrefix(s, ", runs again at ")
	if !ok {
		return nil, false
	}
	// RetryAt is written in UTC, so its text ends at the first 'Z'.
	z := strings.IndexByte(s, 'Z')
	if z < 0 {
		return nil, false
	}
	if te.RetryAt, err = time.Parse(time.RFC3339Nano, s[:z+1]); err != nil {
		return nil, false
	}
	s = s[z+1:]
	if rest, found := strings.CutPrefix(s, requeuedLead); found {
		id, cause, hasCause := strings.Cut(rest, ": ")
		if id == "" {
			return nil, false
		}
		te.Requeued = id
		if hasCause {
			te.Err = errors.New(cause)
		}
		return te, true
	}
	switch {
	case s == "":
	case strings.HasPrefix(s, ": "):
		te.Err = errors.New(s[2:])
	default:
		return nil, false
	}
	return te, true
}

// The fixed parts of ThrottledError.Error's text.
const (
	throttledLead = "admission: waiting, not failed: "
	requeuedLead  = "; requeued as task "
)

// quoted reads lead, then a Go-quoted string, from the start of s, and
// returns the string unquoted and what follows it.
func quoted(s, lead string) (string, string, error) {
	s, ok := strings.CutPrefix(s, lead)
	if !ok {
		return "", "", errors.New("no " + lead)
	}
	q, err := strconv.QuotedPrefix(s)
	if err != nil {
		return "", "", err
	}
	v, err := strconv.Unquote(q)
	return v, s[len(q):], err
}
