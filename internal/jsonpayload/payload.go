// Package jsonpayload reads the top-level fields of a task's JSON payload that
// jobthrottle needs: a subject (a string or a number) and a cost (a whole
// number of permits). The rules file (package rules), the worker
// middleware, the handlers (URL and argument placeholders) and the
// producers (package enqueue) all read payloads through it, so they agree
// on every payload and say the same when one is unusable.
//
// Imports: the standard library only.
package jsonpayload

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
)

// MaxCost bounds a cost, whatever its source.
const MaxCost = 1 << 30

// Field returns the top-level field name of the JSON object payload as a
// string. A string value is used as is; a number is used as written in
// the payload (so 42 and 42.0 are different values). A payload that is
// not a JSON object, a missing field, and a value that is null, empty, or
// not a string or number are errors.
func Field(payload []byte, name string) (string, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil || fields == nil {
		return "", fmt.Errorf("payload is not a JSON object, so it has no field %q", name)
	}
	raw, ok := fields[name]
	if !ok {
		return "", fmt.Errorf("payload has no field %q", name)
	}
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) > 0 && raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("payload field %q: %v", name, err)
		}
		if s == "" {
			return "", fmt.Errorf("payload field %q is an empty string", name)
		}
		return s, nil
	case isNumber(raw):
		return string(raw), nil
	default:
		return "", fmt.Errorf("payload field %q is %s; want a string or a number", name, kind(raw))
	}
}

// Cost returns the top-level field name of the JSON object payload as a
// whole number from 0 to MaxCost. A missing field, another type, a
// fraction or a number out of range is an error.
func Cost(payload []byte, name string) (int, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil || fields == nil {
		return 0, fmt.Errorf("payload is not a JSON object, so it has no cost field %q", name)
	}
	raw, ok := fields[name]
	if !ok {
		return 0, fmt.Errorf("payload has no cost field %q", name)
	}
	raw = bytes.TrimSpace(raw)
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		what := kind(raw)
		if isNumber(raw) {
			what = string(raw)
		}
		return 0, fmt.Errorf("payload cost field %q is %s; want a whole number of permits", name, what)
	}
	if n < 0 || n > MaxCost {
		return 0, fmt.Errorf("payload cost field %q is %d; want 0 to %d permits", name, n, MaxCost)
	}
	return int(n), nil
}

// isNumber reports whether raw, a JSON value, is a number.
func isNumber(raw []byte) bool {
	return len(raw) > 0 && (raw[0] == '-' || '0' <= raw[0] && raw[0] <= '9')
}

// kind names the JSON type of raw for error messages.
func kind(raw []byte) string {
	switch {
	case len(raw) == 0:
		return "empty"
	case raw[0] == '{':
		return "an object"
	case raw[0] == '[':
		return "an array"
	case raw[0] == '"':
		return "a string"
	case bytes.Equal(raw, []byte("null")):
		return "null"
	default:
		return "a boolean"
	}
}

// Level returns the top-level field name of the JSON object payload as a
// whole number from 0 to hi (a task's priority): 0 if the payload has no
// such field. A payload that is not a JSON object, another type, a
// fraction or a number out of range is an error.
func Level(payload []byte, name string, hi int) (int, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil || fields == nil {
		return 0, fmt.Errorf("payload is not a JSON object, so it has no priority field %q", name)
	}
	raw, ok := fields[name]
	if !ok {
		return 0, nil
	}
	raw = bytes.TrimSpace(raw)
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil || n < 0 || n > int64(hi) {
		what := kind(raw)
		if isNumber(raw) {
			what = string(raw)
		}
		return 0, fmt.Errorf("payload priority field %q is %s; want a whole number from 0 to %d", name, what, hi)
	}
	return int(n), nil
}
