package httpthrottle

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// RateLimitInfo is what a response's rate-limit headers say about the
// upstream's limit. The zero value says nothing.
type RateLimitInfo struct {
	// Quota requests per Window: the upstream's policy. Both zero if the
	// response names no window.
	Quota  int
	Window time.Duration
	// Limit is a quota whose window the response does not name
	// (X-RateLimit-Limit, RateLimit-Limit, the dictionary form's limit);
	// zero if none. The Transport reads it as a policy over the longest
	// reset it has seen.
	Limit int
	// Remaining requests until Reset, if HasRemaining.
	Remaining    int
	HasRemaining bool
	// Reset is how long until Remaining is restored, if HasReset.
	// ResetWhole reports that it was given in whole seconds, so that the
	// window really resets after Reset − 1s and by Reset; otherwise (a
	// fraction, or a Unix time) it names the moment.
	Reset      time.Duration
	HasReset   bool
	ResetWhole bool
}

// ParseRateLimitHeaders reads the rate-limit fields of a response:
//
//   - the IETF RateLimit and RateLimit-Policy fields
//     (draft-ietf-httpapi-ratelimit-headers), in both forms the drafts
//     used: the structured `RateLimit-Policy: "default";q=100;w=10` with
//     `RateLimit: "default";r=42;t=7`, and the dictionary `RateLimit:
//     limit=100, remaining=42, reset=7` with `RateLimit-Policy: 100;w=10`;
//     and the separate RateLimit-Limit (a number, or quota policies such
//     as `100, 100;w=60`), -Remaining and -Reset fields;
//   - the common X-RateLimit-Limit, X-RateLimit-Remaining and
//     X-RateLimit-Reset, whose reset is seconds from now or, when it is
//     beyond half of now's Unix time, a Unix time (read against now, the
//     response's Date when it has one).
//
// Of several policies it keeps the slowest (least quota per second), of
// several limits the least, of several remaining counts the least (with
// its reset). Values that do not parse are ignored. It reports false if
// nothing was learned.
func ParseRateLimitHeaders(h http.Header, now time.Time) (RateLimitInfo, bool) {
	var p infoParser
	for _, v := range h.Values("RateLimit-Policy") {
		for _, it := range sfItems(v) {
			w, okW := seconds(it.params["w"])
			if q, ok := nonNegInt(it.params["q"]); ok && okW { // "name";q=100;w=10
				p.policy(q, w)
			} else if q, ok := nonNegInt(it.value); ok && okW { // 100;w=10
				p.policy(q, w)
			}
		}
	}
	for _, v := range h.Values("RateLimit") {
		p.rateLimit(v)
	}
	for _, prefix := range []string{"RateLimit-", "X-RateLimit-"} {
		p.limitField(h.Values(prefix + "Limit"))
		r, okR := nonNegInt(firstItem(h.Get(prefix + "Remaining")))
		if !okR {
			continue
		}
		t, whole, okT := resetIn(firstItem(h.Get(prefix+"Reset")), now)
		p.remaining(r, t, whole, okT)
	}
	info := p.info
	return info, info.Window > 0 || info.Limit > 0 || info.HasRemaining
}

// infoParser gathers a RateLimitInfo from several fields.
type infoParser struct{ info RateLimitInfo }

// remaining keeps the least remaining count, with its reset.
func (p *infoParser) remaining(n int, reset time.Duration, whole, hasReset bool) {
	in := &p.info
	if !in.HasRemaining || n < in.Remaining {
		in.Remaining, in.HasRemaining = n, true
		if hasReset {
			in.Reset, in.ResetWhole, in.HasReset = reset, whole, true
		}
	} else if hasReset && !in.HasReset {
		in.Reset, in.ResetWhole, in.HasReset = reset, whole, true
	}
}

// policy keeps the slowest policy.
func (p *infoParser) policy(q int, w time.Duration) {
	in := &p.info
	if q <= 0 || w <= 0 {
		return
	}
	if in.Window == 0 || float64(q)/w.Seconds() < float64(in.Quota)/in.Window.Seconds() {
		in.Quota, in.Window = q, w
	}
}

// limit keeps the least limit.
func (p *infoParser) limit(n int) {
	if n > 0 && (p.info.Limit == 0 || n < p.info.Limit) {
		p.info.Limit = n
	}
}

// rateLimit reads one RateLimit field: structured items ("name";r=42;t=7)
// or a dictionary (limit=100, remaining=42, reset=7).
func (p *infoParser) rateLimit(v string) {
	dict := map[string]string{}
	for _, it := range sfItems(v) {
		if r, ok := nonNegInt(it.params["r"]); ok {
			t, okT := seconds(it.params["t"])
			p.remaining(r, t, okT && wholeNumber(it.params["t"]), okT)
			continue
		}
		if k, val, ok := strings.Cut(it.value, "="); ok {
			dict[strings.ToLower(strings.TrimSpace(k))] = strings.TrimSpace(val)
		}
	}
	if l, ok := nonNegInt(dict["limit"]); ok {
		p.limit(l)
	}
	if r, ok := nonNegInt(dict["remaining"]); ok {
		t, okT := seconds(dict["reset"])
		p.remaining(r, t, okT && wholeNumber(dict["reset"]), okT)
	}
}

// limitField reads RateLimit-Limit or X-RateLimit-Limit: a number, or a
// list whose first member is one and whose others may be quota policies
// (100, 100;w=60).
func (p *infoParser) limitField(values []string) {
	for _, v := range values {
		for i, it := range sfItems(v) {
			q, ok := nonNegInt(it.value)
			if !ok {
				continue
			}
			if w, okW := seconds(it.params["w"]); okW {
				p.policy(q, w)
			} else if i == 0 {
				p.limit(q)
			}
		}
	}
}

// sfItem is one member of a structured-field list: its value and its
// parameters, parsed loosely (quotes dropped, keys lower case).
type sfItem struct {
	value  string
	params map[string]string
}

// sfItems splits a field value into its comma-separated members and each
// member's ';' parameters.
func sfItems(v string) []sfItem {
	var out []sfItem
	for member := range strings.SplitSeq(v, ",") {
		parts := strings.Split(member, ";")
		it := sfItem{value: strings.Trim(strings.TrimSpace(parts[0]), `"`), params: map[string]string{}}
		for _, p := range parts[1:] {
			k, val, _ := strings.Cut(p, "=")
			it.params[strings.ToLower(strings.TrimSpace(k))] = strings.Trim(strings.TrimSpace(val), `"`)
		}
		out = append(out, it)
	}
	return out
}

// firstItem is the first member of a list value, without parameters:
// "100, 100;w=60" gives "100".
func firstItem(v string) string {
	v, _, _ = strings.Cut(v, ",")
	v, _, _ = strings.Cut(v, ";")
	return strings.TrimSpace(v)
}

func nonNegInt(s string) (int, bool) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	return n, err == nil && n >= 0
}

// wholeNumber reports whether s is a number of seconds without a
// fraction, which stands for any time up to a second less.
func wholeNumber(s string) bool {
	return !strings.ContainsAny(s, ".eE")
}

// seconds reads a non-negative number of seconds, whole or decimal.
func seconds(s string) (time.Duration, bool) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) || f > MaxPause.Seconds() {
		return 0, false
	}
	return time.Duration(f * float64(time.Second)), true
}

// resetIn reads a reset: delta seconds (whole reports that it had no
// fraction), or a Unix time, which names the moment. A value beyond half
// of now's Unix time is a Unix time: a delta that large would be decades.
func resetIn(s string, now time.Time) (d time.Duration, whole, ok bool) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, false, false
	}
	if f > float64(now.Unix())/2 {
		d := time.Unix(0, int64(f*1e9)).Sub(now)
		return max(d, 0), false, d <= MaxPause
	}
	d, ok = seconds(s)
	return d, ok && wholeNumber(s), ok
}

// answer is what a response tells the upstream schedule (throttle.Answer).
func answer(info RateLimitInfo, tooMany bool) throttle.Answer {
	a := throttle.Answer{TooMany: tooMany, Quota: info.Quota, Window: info.Window, Limit: info.Limit,
		Remaining: info.Remaining, HasRemaining: info.HasRemaining, HasReset: info.HasReset,
		ResetMin: info.Reset, ResetMax: info.Reset}
	if info.ResetWhole {
		a.ResetMin = max(info.Reset-time.Second, 0)
	}
	return a
}

// informative reports whether an answer can change what the fleet knows
// (learned when d was booked), so that Learn is worth a round trip: a new
// policy or limit, a reset longer than the inferred window, or a window
// with fewer requests left than the schedule would send before it
// resets at the earliest (or none left). 429s and the first answer always
// go to Learn (RoundTrip).
//
// The schedule sends a request an interval after this one at the soonest,
// so before a reset R away it sends at most ⌊rate × R⌋: a window is news
// only with fewer left than that. Compared with rate × R itself, a window
// left exactly as full as the schedule needs was news whenever the rate
// had grown a little past the quota's share: at an API resetting at each
// second (a reset as a Unix time), every request of one second in eight
// went to Learn, 0.14 more calls a task (BENCHMARKS.md).
func informative(info RateLimitInfo, learned throttle.Learned) bool {
	switch {
	case info.Window > 0:
		return info.Quota != learned.Quota || info.Window != learned.Window
	case info.Limit > 0:
		if info.Limit != learned.Quota || (info.HasReset && info.Reset > learned.Window) {
			return true
		}
	}
	if !info.HasRemaining || !info.HasReset {
		return false
	}
	rate := learned.Rate
	if rate == 0 && learned.Window > 0 {
		rate = float64(learned.Quota) / learned.Window.Seconds()
	}
	if rate == 0 {
		return true // no rate: the window is all there is to go by
	}
	a := answer(info, false)
	return float64(info.Remaining) < math.Floor(rate*a.ResetMin.Seconds()) || info.Remaining == 0
}
