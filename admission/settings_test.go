package admission

import (
	"errors"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// TestSettingsCheck: every field out of range is refused with its name, as
// the rules file spells it, and a share limit a limiter's rules cannot
// keep unwraps to throttle's *ConfigError.
func TestSettingsCheck(t *testing.T) {
	window := throttle.Rule{Name: "w", Algorithm: throttle.SlidingWindow, Limit: throttle.PerSecond(100)}
	gcra := throttle.Rule{Name: "g", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(100)}
	for _, tc := range []struct {
		name  string
		s     Settings
		rules []throttle.Rule
		field string // "" if valid
	}{
		{"zero", Settings{}, nil, ""},
		{"all set", Settings{MaxWait: time.Second, WaitSlots: 3, Horizon: MaxHorizon, Weights: map[string]int{"a": 1, "b": MaxWeight}, ShareLimit: throttle.PerSecond(10)}, []throttle.Rule{gcra}, ""},
		{"no line", Settings{Horizon: -1}, nil, ""},
		{"negative max wait", Settings{MaxWait: -1}, nil, "max_wait"},
		{"negative wait slots", Settings{WaitSlots: -1}, nil, "wait_slots"},
		{"horizon past a day", Settings{Horizon: MaxHorizon + 1}, nil, "horizon"},
		{"weight zero", Settings{Weights: map[string]int{"a": 0}}, nil, "weights"},
		{"weight too large", Settings{Weights: map[string]int{"a": MaxWeight + 1}}, nil, "weights"},
		{"share limit without period", Settings{ShareLimit: throttle.Limit{Count: 1}}, nil, "share_limit"},
		{"share limit over a window", Settings{ShareLimit: throttle.PerSecond(10)}, []throttle.Rule{window}, "share_limit"},
	} {
		err := tc.s.Check(tc.rules...)
		var se *SettingsError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: got %v, want nil", tc.name, err)
		case tc.field != "" && !errors.As(err, &se):
			t.Errorf("%s: got %v, want a *SettingsError", tc.name, err)
		case tc.field != "" && se.Field != tc.field:
			t.Errorf("%s: got field %q, want %q (%v)", tc.name, se.Field, tc.field, err)
		}
	}
	err := Settings{ShareLimit: throttle.PerSecond(10)}.Check(window)
	if ce := (*throttle.ConfigError)(nil); !errors.As(err, &ce) || ce.Rule != "w" {
		t.Errorf("got %v, want it to unwrap to throttle's error for rule %q", err, "w")
	}
}
