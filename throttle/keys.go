package throttle

import (
	"fmt"
	"strings"
)

// maxSubjectLen bounds a subject's length in bytes, before encoding.
const maxSubjectLen = 1024

// DefaultPrefix is the key prefix used when Options.Prefix is empty, and
// the default of every other part of jobthrottle (the worker's rules file,
// enqueue), so that producers and workers left at their defaults share one
// ledger.
const DefaultPrefix = "jobthrottle:"

// key returns the Redis key of a rule over an encoded subject:
// <prefix>{<subject>}:<rule>. All keys of one subject share the hash tag,
// so a policy's keys live in one Redis Cluster slot.
func key(prefix, subject, rule string) string {
	return prefix + "{" + subject + "}:" + rule
}

// Nest returns the subject inner within outer: a per-key subject inside
// its tenant. A limiter called with it keeps every rule's state under the
// outer subject's hash tag, <prefix>{<outer>}{<inner>}:<rule>, so that
// its rules, and its line, live in the outer subject's Redis Cluster slot
// beside the outer subject's own keys; a rule marked Rule.Outer limits
// the outer subject alone, at the key a limiter called with outer itself
// uses (<prefix>{<outer>}:<rule>). So one atomic call books a task's turn
// under its key's limit and its tenant's together, and the tenant's limit
// is the same one its tenant-wide tasks use. The inner subject is limited
// within its outer one: the same inner subject nested in two outer ones
// is two subjects. Both parts must be valid subjects; a subject holding a
// NUL byte is read as nested at its first NUL.
func Nest(outer, inner string) string { return outer + nestSep + inner }

// nestSep separates a nested subject's parts (Nest).
const nestSep = "\x00"

// splitNest returns the parts of a nested subject, or s and false.
func splitNest(s string) (outer, inner string, nested bool) {
	if i := strings.IndexByte(s, 0); i >= 0 {
		return s[:i], s[i+1:], true
	}
	return s, "", false
}

// nestTag separates a nested subject's encoded parts: the outer one ends
// the hash tag.
const nestTag = "}{"

// subjectKey returns the form of a valid subject inside keys: as
// encodeSubject without its checks.
func subjectKey(s string) string {
	if outer, inner, nested := splitNest(s); nested {
		return escape(outer) + nestTag + escape(inner)
	}
	return escape(s)
}

// outerKey returns the outer part of an encoded subject (subjectKey):
// the whole of one that is not nested.
func outerKey(enc string) string {
	if i := strings.Index(enc, nestTag); i >= 0 {
		return enc[:i]
	}
	return enc
}

// encodeSubject returns the form a subject takes inside keys,
// <prefix>{<encoded subject>}:<rule> (the package doc describes it to
// users). Bytes other than ASCII letters, digits and -._~@/+=, are written
// %XX. The encoding is injective, so two subjects never share a key, and
// its output has no '{' or '}', so it never ends the hash tag early (a
// nested subject's is <outer>}{<inner>: its outer part is the tag). An
// empty subject, or one longer than maxSubjectLen bytes, is an error
// matching ErrInvalidSubject, as is either part of a nested one.
func encodeSubject(s string) (string, error) {
	if outer, inner, nested := splitNest(s); nested {
		if strings.IndexByte(inner, 0) >= 0 {
			return "", fmt.Errorf("%w: nested twice; Nest takes two subjects that are not nested", ErrInvalidSubject)
		}
		for _, part := range []struct{ name, s string }{{"outer", outer}, {"inner", inner}} {
			if err := checkSubject(part.s); err != nil {
				return "", fmt.Errorf("the %s part of a nested subject (Nest): %w", part.name, err)
			}
		}
		return subjectKey(s), nil
	}
	if err := checkSubject(s); err != nil {
		return "", err
	}
	return escape(s), nil
}

// checkSubject checks a subject that is not nested.
func checkSubject(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: empty; name what is limited, such as a tenant id or \"global\"", ErrInvalidSubject)
	case len(s) > maxSubjectLen:
		return fmt.Errorf("%w: %d bytes long, at most %d allowed; hash long subjects before passing them", ErrInvalidSubject, len(s), maxSubjectLen)
	}
	return nil
}

// escape percent-encodes every byte outside the safe set.
func escape(s string) string {
	safe := true
	for i := 0; i < len(s); i++ {
		if !safeByte(s[i]) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if safeByte(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

func safeByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("-._~@/+=,", c) >= 0
}
