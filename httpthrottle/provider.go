package httpthrottle

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ProviderLimit is what an LLM provider's headers say of one of its
// limits: Limit per the provider's window (a minute for OpenAI's and
// Anthropic's limits), Remaining now, and Reset, how long until the limit
// is whole again. The zero value says nothing.
type ProviderLimit struct {
	Limit        int // 0 if not given
	Remaining    int
	HasRemaining bool
	Reset        time.Duration
	HasReset     bool
}

// ProviderLimits are what an LLM provider's rate-limit headers say of
// each of its limits, and how long it asked to wait (RetryAfter, if
// HasRetryAfter: from retry-after-ms if given, else retry-after).
type ProviderLimits struct {
	Requests     ProviderLimit // requests
	Tokens       ProviderLimit // tokens, input and output together (OpenAI), or the tightest token limit now (Anthropic)
	InputTokens  ProviderLimit // input tokens (Anthropic)
	OutputTokens ProviderLimit // output tokens (Anthropic)

	RetryAfter    time.Duration
	HasRetryAfter bool
}

// ParseProviderHeaders reads an LLM provider's rate-limit headers, at
// now (the response's Date, or the local time):
//
//   - OpenAI's (and OpenAI-compatible servers'):
//     x-ratelimit-{limit,remaining,reset}-{requests,tokens}, whose reset
//     is a duration such as 6m0s, 1s or 20ms (a number alone is seconds);
//   - Anthropic's: anthropic-ratelimit-{requests,tokens,input-tokens,
//     output-tokens}-{limit,remaining,reset}, whose reset is an RFC 3339
//     time;
//   - retry-after-ms (milliseconds, a fraction allowed) and retry-after
//     (seconds or an HTTP date).
//
// A value that does not parse, or is negative (some servers send -1 for
// a limit they do not apply), is ignored, and a reset in the past is 0.
// It reports false if none of these headers said anything.
func ParseProviderHeaders(h http.Header, now time.Time) (ProviderLimits, bool) {
	var p ProviderLimits
	found := false
	for _, f := range []struct {
		dst               *ProviderLimit
		openai, anthropic string
	}{
		{&p.Requests, "requests", "requests"},
		{&p.Tokens, "tokens", "tokens"},
		{&p.InputTokens, "", "input-tokens"},
		{&p.OutputTokens, "", "output-tokens"},
	} {
		if f.openai != "" && providerLimit(f.dst, h, "X-Ratelimit-%s-"+f.openai, resetDuration) {
			found = true
		}
		if providerLimit(f.dst, h, "Anthropic-Ratelimit-"+f.anthropic+"-%s", func(s string) (time.Duration, bool) { return resetTime(s, now) }) {
			found = true
		}
	}
	if ms, err := strconv.ParseFloat(strings.TrimSpace(h.Get("Retry-After-Ms")), 64); err == nil && ms >= 0 && ms <= float64(MaxPause.Milliseconds()) {
		p.RetryAfter, p.HasRetryAfter = time.Duration(ms*float64(time.Millisecond)), true
	} else if d, ok := ParseRetryAfter(h.Get("Retry-After"), now); ok {
		p.RetryAfter, p.HasRetryAfter = d, true
	}
	return p, found || p.HasRetryAfter
}

// providerLimit reads one limit's three fields, named by pattern with %s
// standing for limit, remaining and reset, into dst; it reports whether
// any was there.
func providerLimit(dst *ProviderLimit, h http.Header, pattern string, reset func(string) (time.Duration, bool)) bool {
	field := func(f string) string { return strings.TrimSpace(h.Get(strings.Replace(pattern, "%s", f, 1))) }
	found := false
	if n, ok := nonNegInt(field("Limit")); ok && n > 0 {
		dst.Limit, found = n, true
	}
	if n, ok := nonNegInt(field("Remaining")); ok {
		dst.Remaining, dst.HasRemaining, found = n, true, true
	}
	if s := field("Reset"); s != "" {
		if d, ok := reset(s); ok {
			dst.Reset, dst.HasReset, found = d, true, true
		}
	}
	return found
}

// resetDuration reads OpenAI's reset: a Go-style duration (6m0s, 1s,
// 20ms, 1h2m3.5s) or a number of seconds.
func resetDuration(s string) (time.Duration, bool) {
	if d, err := time.ParseDuration(s); err == nil {
		return d, d >= 0 && d <= MaxPause
	}
	return seconds(s)
}

// resetTime reads Anthropic's reset, an RFC 3339 time, as the time from
// now until it (0 if it has passed).
func resetTime(s string, now time.Time) (time.Duration, bool) {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return 0, false
	}
	d := max(t.Sub(now), 0)
	return d, d <= MaxPause
}
