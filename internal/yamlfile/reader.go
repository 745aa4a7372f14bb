// Package yamlfile reads YAML files node by node so that every error names
// the file, the line and the field. The rules file's parsers (package
// rules, and package handler for its handlers section) and the schedules
// file's (package enqueue) share it, each building a *rules.Error in
// Reader.Fail:
//
//	r := &yamlfile.Reader{Fail: func(line int, field, reason string) error {
//		return &rules.Error{File: name, Line: line, Field: field, Reason: reason}
//	}}
//	root, err := r.Root(data, "rules", "the file is empty")
//	fields, err := r.Mapping(root, "", "the file", []string{"prefix", "rules"})
//	prefix, err := r.Prefix(fields["prefix"], "prefix", throttle.DefaultPrefix)
//
// Each mapping's fields are declared once, with how each is read
// (Reader.Fields, decl.go), so that the list of allowed fields, the
// required ones and their readers cannot drift apart. It also reads the
// fields those files share (fields.go): names, the key prefix, a subject.
//
// Imports: the YAML parser and throttle (subjects); it must not import
// rules, worker, enqueue or handler.
package yamlfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Reader reads the nodes of one YAML file and reports the first problem
// through Fail. Its methods expect nodes that are not nil.
type Reader struct {
	// Fail builds the error for a problem with field ("" for the file or
	// the node as a whole) on line (1-based; 0 if unknown). It must not
	// return nil.
	Fail func(line int, field, reason string) error
	// DurationExamples ends the reason Duration gives for a value that is
	// not a string: "… must be a duration with a unit, such as
	// <DurationExamples>".
	DurationExamples string
	// DurationSyntax ends the reason Duration gives for a string that is
	// not a duration: "… is not a duration; write a number and a unit
	// <DurationSyntax>".
	DurationSyntax string
}

// Failf reports a problem with field at node n (nil: no line) through
// Fail, the reason formatted as by fmt.Sprintf.
func (r *Reader) Failf(n *yaml.Node, field, format string, args ...any) error {
	line := 0
	if n != nil {
		line = n.Line
	}
	return r.Fail(line, field, fmt.Sprintf(format, args...))
}

// Root decodes data, which must hold one YAML document, and returns the
// document's top node. empty is the reason for a file without a document;
// kind names the file in the reason for a second one ("a second YAML
// document; a <kind> file holds one").
func (r *Reader) Root(data []byte, kind, empty string) (*yaml.Node, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc, more yaml.Node
	switch err := dec.Decode(&doc); {
	case errors.Is(err, io.EOF):
		return nil, r.Fail(0, "", empty)
	case err != nil:
		return nil, r.syntaxError(err)
	}
	switch err := dec.Decode(&more); {
	case err == nil:
		return nil, r.Failf(&more, "", "a second YAML document; a %s file holds one", kind)
	case !errors.Is(err, io.EOF):
		return nil, r.syntaxError(err)
	}
	if len(doc.Content) == 0 { // yaml gives every document one node, but in case
		return nil, r.Failf(&doc, "", "%s", empty)
	}
	return doc.Content[0], nil
}

// syntaxLineRE splits the line off a YAML library error.
var syntaxLineRE = regexp.MustCompile(`^yaml: (?:line (\d+): )?(.*)$`)

// syntaxError reports a YAML library error as "invalid YAML: …", on the
// line the library names.
func (r *Reader) syntaxError(err error) error {
	line, reason := 0, err.Error()
	if m := syntaxLineRE.FindStringSubmatch(reason); m != nil {
		line, _ = strconv.Atoi(m[1])
		reason = m[2]
	}
	return r.Fail(line, "", "invalid YAML: "+reason)
}

// Mapping returns the fields of the mapping at n by key, refusing keys
// that are not in allowed, that repeat or that are not scalars, and a
// node that is not a mapping. field is the mapping's path, what names it
// in reasons ("a rule"). Aliases are followed, for n and for each value.
func (r *Reader) Mapping(n *yaml.Node, field, what string, allowed []string) (map[string]*yaml.Node, error) {
	n = Resolve(n)
	if n.Kind != yaml.MappingNode {
		return nil, r.Failf(n, field, "%s must be a mapping with the fields %s", what, strings.Join(allowed, ", "))
	}
	fields := map[string]*yaml.Node{}
	keyLine := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := Resolve(n.Content[i]), Resolve(n.Content[i+1])
		if k.Kind != yaml.ScalarNode {
			return nil, r.Failf(k, field, "%s has a key that is not a plain name", what)
		}
		name := k.Value
		if line, dup := keyLine[name]; dup {
			return nil, r.Failf(k, Join(field, name), "repeats the field set on line %d; give it once", line)
		}
		if !slices.Contains(allowed, name) {
			return nil, r.Failf(k, field, "unknown field %q in %s; allowed: %s", name, what, strings.Join(allowed, ", "))
		}
		keyLine[name] = k.Line
		fields[name] = v
	}
	return fields, nil
}

// Str reads a string: a scalar with the !!str tag, so 12, true and an
// empty value are refused.
func (r *Reader) Str(n *yaml.Node, field string) (string, error) {
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!str" {
		return "", r.Failf(n, field, "%s must be a string", Describe(n))
	}
	return n.Value, nil
}

// Bool reads true or false (or another YAML spelling of them, such as
// True).
func (r *Reader) Bool(n *yaml.Node, field string) (bool, error) {
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!bool" {
		var b bool
		if err := n.Decode(&b); err == nil {
			return b, nil
		}
	}
	return false, r.Failf(n, field, "%s must be true or false", Describe(n))
}

// Int reads a whole number from lo to hi. A number written in decimal
// digits too large for an int64 is "too large" (YAML reads it as a float);
// the error gives hi. Upper bounds that another package states, such as
// throttle.MaxPermits, are passed as hi so that the file's error gives
// them.
func (r *Reader) Int(n *yaml.Node, field string, lo, hi int64) (int, error) {
	if overflows(n) {
		return 0, r.Failf(n, field, "%q is too large: at most %d", n.Value, hi)
	}
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
		return 0, r.Failf(n, field, "%s must be a whole number from %d to %d", Describe(n), lo, hi)
	}
	var v int64
	if err := n.Decode(&v); err != nil || v < lo || v > hi {
		return 0, r.Failf(n, field, "%q must be a whole number from %d to %d", n.Value, lo, hi)
	}
	return int(v), nil
}

// AtLeast reads a whole number of at least lo, for a quantity whose upper
// bound hi few files come near (a limit's count, say): a smaller value
// "must be a whole number, at least lo", and a larger one, even beyond what
// an int64 holds, is "too large: at most hi". Pass the bound of the
// package that enforces it (throttle.MaxPermits), so that it is stated once.
func (r *Reader) AtLeast(n *yaml.Node, field string, lo, hi int64) (int, error) {
	if overflows(n) {
		return 0, r.Failf(n, field, "%q is too large: at most %d", n.Value, hi)
	}
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
		return 0, r.Failf(n, field, "%s must be a whole number, at least %d", Describe(n), lo)
	}
	var v int64
	if err := n.Decode(&v); err != nil || v < lo {
		return 0, r.Failf(n, field, "%q must be a whole number, at least %d", n.Value, lo)
	}
	if v > hi {
		return 0, r.Failf(n, field, "%q is too large: at most %d", n.Value, hi)
	}
	return int(v), nil
}

// overflows reports whether n is an unquoted positive whole number in
// decimal digits that an int64 cannot hold.
func overflows(n *yaml.Node) bool {
	if n.Kind != yaml.ScalarNode || n.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle) != 0 {
		return false
	}
	digits := strings.TrimPrefix(n.Value, "+")
	if digits == "" || strings.Trim(digits, "0123456789") != "" {
		return false
	}
	_, err := strconv.ParseInt(digits, 10, 64)
	return err != nil
}

// Duration reads a Go duration such as 1s, 500ms or 1h30m, from lo to
// hi. A number without a unit is refused.
func (r *Reader) Duration(n *yaml.Node, field string, lo, hi time.Duration) (time.Duration, error) {
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!str" {
		return 0, r.Failf(n, field, "%s must be a duration with a unit, such as %s", Describe(n), r.DurationExamples)
	}
	d, err := time.ParseDuration(n.Value)
	switch {
	case err != nil:
		return 0, r.Failf(n, field, "%q is not a duration; write a number and a unit %s", n.Value, r.DurationSyntax)
	case d < lo:
		return 0, r.Failf(n, field, "%q must be at least %v", n.Value, lo)
	case d > hi:
		return 0, r.Failf(n, field, "%q must be at most %v", n.Value, hi)
	}
	return d, nil
}

// Resolve follows an alias to its anchored node; other nodes, and nil,
// are returned as they are.
func Resolve(n *yaml.Node) *yaml.Node {
	if n != nil && n.Kind == yaml.AliasNode && n.Alias != nil {
		return n.Alias
	}
	return n
}

// Join appends a field name to a path: "limits[1]" + "period" is
// "limits[1].period"; "" + "period" is "period".
func Join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

// Describe quotes a node for reasons: a scalar's text, "an empty value",
// "a mapping" or "a list".
func Describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.ScalarNode:
		if n.ShortTag() == "!!null" {
			return "an empty value"
		}
		return strconv.Quote(n.Value)
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return "this value"
}

// Message is the text of an error in a YAML file: "file:line: kind name:
// field: reason", such as `rules.yaml:7: rule "stripe": period: "0s" must
// be at least 1µs`. It leaves out the line if 0, the kind and name if
// name is "", and the field if "". A name that starts with '#' (a
// position, as in "rule #2") is not quoted.
func Message(file string, line int, kind, name, field, reason string) string {
	var b strings.Builder
	b.WriteString(file)
	if line > 0 {
		b.WriteString(":" + strconv.Itoa(line))
	}
	b.WriteString(": ")
	switch {
	case strings.HasPrefix(name, "#"):
		b.WriteString(kind + " " + name + ": ")
	case name != "":
		b.WriteString(kind + " " + strconv.Quote(name) + ": ")
	}
	if field != "" {
		b.WriteString(field + ": ")
	}
	b.WriteString(reason)
	return b.String()
}
