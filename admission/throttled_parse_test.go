package admission

import (
	"errors"
	"testing"
	"time"
)

// ParseThrottledError reads back every ThrottledError's text, whatever its
// rule and subject hold, and refuses any other text.
func TestParseThrottledError(t *testing.T) {
	at := time.Date(2026, 5, 6, 7, 8, 9, 300_000_000, time.UTC)
	cases := []struct {
		name string
		te   ThrottledError
	}{
		{"parked", ThrottledError{Rule: "stripe", Subject: "acct_42", RetryAt: at, Err: errors.New("worker: parked until its booked turn")}},
		{"no cause", ThrottledError{Rule: "r", Subject: "s", RetryAt: at}},
		{"quotes, colons and Z in names", ThrottledError{Rule: `a "b": Z`, Subject: "x, subject \"y\", runs again at Z: ", RetryAt: at, Err: errors.New("cause: with: colons")}},
		{"requeued", ThrottledError{Rule: "r", Subject: "s", RetryAt: at, Requeued: "abc~throttled2", Err: errors.New("worker: parked until its booked turn")}},
		{"requeued, no cause", ThrottledError{Rule: "r", Subject: "s", RetryAt: at, Requeued: "abc~throttled1"}},
		{"whole second, other zone", ThrottledError{Rule: "r", Subject: "s", RetryAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.FixedZone("x", 3600)), Err: errors.New("e")}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			msg := c.te.Error()
			got, ok := ParseThrottledError(msg)
			if !ok {
				t.Fatalf("ParseThrottledError(%q): not ok", msg)
			}
			if got.Rule != c.te.Rule || got.Subject != c.te.Subject || !got.RetryAt.Equal(c.te.RetryAt) || got.Requeued != c.te.Requeued {
				t.Errorf("got %+v, want %+v", got, c.te)
			}
			if (got.Err == nil) != (c.te.Err == nil) || got.Err != nil && got.Err.Error() != c.te.Err.Error() {
				t.Errorf("Err %v, want %v", got.Err, c.te.Err)
			}
			if got.Error() != msg {
				t.Errorf("Error() %q, want %q", got.Error(), msg)
			}
		})
	}
	for _, msg := range []string{
		"",
		"http: 500 Internal Server Error",
		`admission: waiting, not failed: rule "r", subject "s"`,
		`admission: waiting, not failed: rule "r", subject "s", runs again at soon: x`,
		`admission: waiting, not failed: rule r, subject "s", runs again at 2026-05-06T07:08:09Z`,
		`admission: waiting, not failed: rule "r", subject "s", runs again at 2026-05-06T07:08:09Zjunk`,
		`admission: waiting, not failed: rule "r", subject "s", runs again at 2026-05-06T07:08:09Z; requeued as task : x`,
	} {
		if te, ok := ParseThrottledError(msg); ok {
			t.Errorf("ParseThrottledError(%q) = %+v, want not ok", msg, te)
		}
	}
}
