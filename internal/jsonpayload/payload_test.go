package jsonpayload

import "testing"

func TestField(t *testing.T) {
	for payload, want := range map[string]string{
		`{"tenant": "acme"}`:               "acme",
		`{"tenant": "a{b}c ü"}`:            "a{b}c ü",
		`{"tenant": 42}`:                   "42",
		`{"tenant": -4.2e1}`:               "-4.2e1",
		`{"tenant": "x", "tenant": "y"}`:   "y",
		` { "other": [1], "tenant":"t" } `: "t",
	} {
		got, err := Field([]byte(payload), "tenant")
		if err != nil || got != want {
			t.Errorf("Field(%s) = %q, %v; want %q", payload, got, err, want)
		}
	}
}
