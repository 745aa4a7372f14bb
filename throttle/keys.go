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

// encodeSubject returns the form a subject takes inside keys,
// <prefix>{<encoded subject>}:<rule> (the package doc describes it to
// users). Bytes other than ASCII letters, digits and -._~@/+=, are written
// %XX. The encoding is injective, so two subjects never share a key, and
// its output has no '{' or '}', so it never ends the hash tag early. An
// empty subject, or one longer than maxSubjectLen bytes, is an error
// matching ErrInvalidSubject.
func encodeSubject(s string) (string, error) {
	switch {
	case s == "":
		return "", fmt.Errorf("%w: empty; name what is limited, such as a tenant id or \"global\"", ErrInvalidSubject)
	case len(s) > maxSubjectLen:
		return "", fmt.Errorf("%w: %d bytes long, at most %d allowed; hash long subjects before passing them", ErrInvalidSubject, len(s), maxSubjectLen)
	}
	return escape(s), nil
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
