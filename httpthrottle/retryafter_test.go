package httpthrottle

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

var retryNow = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func TestParseRetryAfter(t *testing.T) {
	cases := []struct {
		name string
		h    string
		want time.Duration
		ok   bool
	}{
		{"delta", "120", 120 * time.Second, true},
		{"zero", "0", 0, true},
		{"leading zeros", "007", 7 * time.Second, true},
		{"spaces and tabs", " \t5\t ", 5 * time.Second, true},
		{"2^31", "2147483648", 1 << 31 * time.Second, true},
		{"above 2^31", "2147483649", 1 << 31 * time.Second, true},
		{"overflows uint64", "99999999999999999999999999", 1 << 31 * time.Second, true},
		{"IMF-fixdate", "Sun, 01 Mar 2026 12:00:30 GMT", 30 * time.Second, true},
		{"RFC 850", "Sunday, 01-Mar-26 12:01:00 GMT", time.Minute, true},
		{"asctime", "Sun Mar  1 12:00:02 2026", 2 * time.Second, true},
		{"date in the past", "Sun, 01 Mar 2026 11:00:00 GMT", 0, true},
		{"date now", "Sun, 01 Mar 2026 12:00:00 GMT", 0, true},
		{"far future date", "Fri, 31 Dec 9999 23:59:59 GMT", time.Duration(1<<63 - 1), true},
		{"empty", "", 0, false},
		{"blank", "  ", 0, false},
		{"negative", "-1", 0, false},
		{"plus", "+1", 0, false},
		{"fraction", "1.5", 0, false},
		{"exponent", "1e3", 0, false},
		{"hex", "0x10", 0, false},
		{"unit", "10s", 0, false},
		{"two values", "1, 2", 0, false},
		{"inner space", "1 2", 0, false},
		{"non-GMT zone", "Sunday, 01-Mar-26 12:01:00 PST", 0, false},
		{"numeric zone", "Sun, 01 Mar 2026 12:00:30 +0000", 0, false},
		{"lower-case gmt", "Sun, 01 Mar 2026 12:00:30 gmt", 0, false},
		{"ISO 8601", "2026-03-01T12:00:30Z", 0, false},
		{"garbage", "soon", 0, false},
		{"unicode digits", "١٢", 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, ok := ParseRetryAfter(c.h, retryNow)
			if got != c.want || ok != c.ok {
				t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", c.h, got, ok, c.want, c.ok)
			}
		})
	}
}

// FuzzParseRetryAfter checks that ParseRetryAfter never panics, never
// returns a negative duration, accepts every delta-seconds and agrees with
// itself on a date written back in the canonical form.
func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"0", "120", "Sun, 01 Mar 2026 12:00:30 GMT", "Sunday, 01-Mar-26 12:01:00 GMT",
		"Sun Mar  1 12:00:02 2026", "-1", "1.5", " 7 ", "99999999999999999999999999", "", "soon"} {
		f.Add(s, int64(0))
	}
	f.Fuzz(func(t *testing.T, h string, offset int64) {
		now := retryNow.Add(time.Duration(offset))
		d, ok := ParseRetryAfter(h, now)
		if d < 0 {
			t.Fatalf("ParseRetryAfter(%q) = %v < 0", h, d)
		}
		if !ok && d != 0 {
			t.Fatalf("ParseRetryAfter(%q) = %v, false: want 0 when not ok", h, d)
		}
		trimmed := strings.Trim(h, " \t")
		if trimmed != "" && strings.Trim(trimmed, "0123456789") == "" {
			if !ok || d > (1<<31)*time.Second {
				t.Fatalf("delta-seconds %q = %v, %v; want ok and at most 2^31 s", h, d, ok)
			}
			return
		}
		if !ok {
			return
		}
		when, err := http.ParseTime(trimmed)
		if err != nil {
			t.Fatalf("ParseRetryAfter(%q) ok, but it is neither delta-seconds nor an HTTP-date", h)
		}
		d2, ok2 := ParseRetryAfter(when.UTC().Format(http.TimeFormat), now)
		if !ok2 || d2 != d {
			t.Fatalf("ParseRetryAfter(%q) = %v but its IMF-fixdate form gives %v, %v", h, d, d2, ok2)
		}
	})
}
