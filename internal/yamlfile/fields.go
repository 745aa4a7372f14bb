package yamlfile

import (
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// The fields that jobthrottle's files share (the rules file and the
// schedules file): names, the key prefix and a subject. Each is read here
// once, so both files accept the same values and say the same of a bad
// one.

// nameRE is what names of rules, limits, budgets and schedules may look
// like: they become metric labels and parts of Redis keys.
var nameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// NameRule says what a name may be, for messages: "use " + NameRule.
const NameRule = "letters, digits, '-' and '_' only, at most 64"

// ValidName reports whether s may name a rule, a limit, a budget or a
// schedule (NameRule).
func ValidName(s string) bool { return nameRE.MatchString(s) }

// Name reads the name (node nn; nil if missing) of the entry at n, such as
// a rule, a limit of a policy, a budget or a schedule: a string that
// passes ValidName and is not yet in seen (name → line), which it is added
// to. give names the entry for a missing name ("the rule", "each budget":
// "missing; give the rule a name"), kind for a repeated one ("rule": "…
// is also the name of the rule on line 2; names must be unique"), and
// within ends that message (" within a rule", or "").
func (r *Reader) Name(n, nn *yaml.Node, field, give, kind, within string, seen map[string]int) (string, error) {
	if nn == nil {
		return "", r.Failf(n, field, "missing; give %s a name (%s)", give, NameRule)
	}
	name, err := r.Str(nn, field)
	if err != nil {
		return "", err
	}
	if !ValidName(name) {
		return "", r.Failf(nn, field, "%q: use %s", name, NameRule)
	}
	if line, dup := seen[name]; dup {
		return "", r.Failf(nn, field, "%q is also the name of the %s on line %d; names must be unique%s", name, kind, line, within)
	}
	seen[name] = nn.Line
	return name, nil
}

// Prefix reads a key prefix: a string that is not blank and has no '{'
// or '}', which delimit the subject's hash tag in every key. def is the
// default, named in the message for an empty one.
func (r *Reader) Prefix(n *yaml.Node, field, def string) (string, error) {
	p, err := r.Str(n, field)
	switch {
	case err != nil:
		return "", err
	case strings.TrimSpace(p) == "":
		return "", r.Failf(n, field, "must not be empty; leave it out for %q", def)
	case strings.ContainsAny(p, "{}"):
		return "", r.Failf(n, field, "%q must not contain '{' or '}', which delimit the subject's hash tag", p)
	}
	return p, nil
}

// SubjectHelp says how to write a subject, for messages.
const SubjectHelp = "give {payload_field: <JSON field>} or {fixed: <subject>}"

// Subject reads a subject mapping at field: exactly one of fixed (a
// subject that throttle accepts) and payload_field (the name of a
// top-level field of the JSON payload).
func (r *Reader) Subject(n *yaml.Node, field string) (fixed, payloadField string, err error) {
	fields, err := r.Mapping(n, field, "subject", []string{"fixed", "payload_field"})
	if err != nil {
		return "", "", err
	}
	if len(fields) != 1 {
		return "", "", r.Failf(n, field, "%s, exactly one of them", SubjectHelp)
	}
	if v := fields["fixed"]; v != nil {
		if fixed, err = r.Str(v, Join(field, "fixed")); err != nil {
			return "", "", err
		}
		if _, err := throttle.EncodeSubject(fixed); err != nil {
			return "", "", r.Failf(v, Join(field, "fixed"), "%q: %v", fixed, err)
		}
		return fixed, "", nil
	}
	v := fields["payload_field"]
	if payloadField, err = r.Str(v, Join(field, "payload_field")); err != nil {
		return "", "", err
	}
	if strings.TrimSpace(payloadField) == "" {
		return "", "", r.Failf(v, Join(field, "payload_field"), `must name a top-level field of the JSON payload, such as "tenant_id"`)
	}
	return "", payloadField, nil
}
