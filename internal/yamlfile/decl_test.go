package yamlfile

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// TestFields: a mapping read from declarations refuses undeclared keys
// (listing the declared ones in order), reports a missing required field
// at the mapping, reads the others into their targets, and runs each
// Check in the order declared, after the fields before it.
func TestFields(t *testing.T) {
	type entry struct {
		Name  string
		N     int
		D     time.Duration
		On    bool
		order []string
	}
	decl := func(r *Reader, e *entry) []Field {
		return []Field{
			{Key: "name", Missing: "give a name", Read: r.StrTo(&e.Name)},
			{Key: "n", Read: r.IntTo(&e.N, 1, 10), Check: func() error {
				e.order = append(e.order, "n")
				if e.N == 7 && e.Name == "seven" {
					return errors.New("seven may not be 7")
				}
				return nil
			}},
			{Key: "d", Read: r.DurationTo(&e.D, time.Second, time.Hour)},
			{Key: "on", Read: r.BoolTo(&e.On), Check: func() error { e.order = append(e.order, "on"); return nil }},
		}
	}
	for _, tc := range []struct{ name, doc, want string }{
		{"all", "name: a\nn: 3\nd: 1m\non: true\n", "{a 3 1m0s true [n on]}"},
		{"defaults", "name: a\n", "{a 0 0s false [n on]}"},
		{"missing", "n: 3\n", "1: name: missing; give a name"},
		{"unknown", "name: a\nm: 1\n", `2: : unknown field "m" in an entry; allowed: name, n, d, on`},
		{"bad value", "name: a\nn: 11\n", `2: n: "11" must be a whole number from 1 to 10`},
		{"check after its field", "name: seven\nn: 7\nd: 0s\n", "seven may not be 7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := testReader()
			root, err := r.Root([]byte(tc.doc), "test", "empty")
			if err != nil {
				t.Fatal(err)
			}
			var e entry
			got := ""
			if _, err := r.Fields(root, "", "an entry", decl(r, &e)); err != nil {
				got = err.Error()
			} else {
				got = fmt.Sprintf("{%s %d %v %v %v}", e.Name, e.N, e.D, e.On, e.order)
			}
			if got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}
