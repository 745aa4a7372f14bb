package yamlfile

import (
	"fmt"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// testReader reports errors as "line: field: reason".
func testReader() *Reader {
	return &Reader{
		Fail: func(line int, field, reason string) error {
			return fmt.Errorf("%d: %s: %s", line, field, reason)
		},
		DurationExamples: "1s or 1h",
		DurationSyntax:   "(s, h)",
	}
}

// read parses doc, a YAML mapping {a: …, b: …}, and reads its fields
// with read, returning what read returns as text.
func read(t *testing.T, doc string, read func(r *Reader, fields map[string]*yaml.Node) (any, error)) string {
	t.Helper()
	r := testReader()
	root, err := r.Root([]byte(doc), "test", "empty file")
	if err != nil {
		return err.Error()
	}
	fields, err := r.Mapping(root, "", "the file", []string{"a", "b", "c"})
	if err != nil {
		return err.Error()
	}
	v, err := read(r, fields)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprint(v)
}

func TestRootAndMapping(t *testing.T) {
	keys := func(_ *Reader, fields map[string]*yaml.Node) (any, error) {
		var got []string
		for _, k := range []string{"a", "b", "c"} {
			if n := fields[k]; n != nil {
				got = append(got, k+"="+Describe(n))
			}
		}
		return got, nil
	}
	for _, tc := range []struct{ name, doc, want string }{
		{"fields", "a: 1\nb: x\n", `[a="1" b="x"]`},
		{"empty file", "", "0: : empty file"},
		{"comments only", "# nothing\n", "0: : empty file"},
		{"second document", "a: 1\n---\nb: 2\n", "2: : a second YAML document; a test file holds one"},
		{"syntax", "a: [1\n", "1: : invalid YAML: did not find expected ',' or ']'"},
		{"not a mapping", "- a\n", "1: : the file must be a mapping with the fields a, b, c"},
		{"unknown field", "a: 1\nd: 2\n", `2: : unknown field "d" in the file; allowed: a, b, c`},
		{"repeated field", "a: 1\nb: 2\na: 3\n", "3: a: repeats the field set on line 1; give it once"},
		{"key not a name", "[a]: 1\n", "1: : the file has a key that is not a plain name"},
		{"alias value", "a: &x [1]\nb: *x\n", `[a=a list b=a list]`},
		{"alias mapping", "&m {a: 1}\n", `[a="1"]`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := read(t, tc.doc, keys); got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}

func TestScalars(t *testing.T) {
	str := func(r *Reader, f map[string]*yaml.Node) (any, error) { return r.Str(f["a"], "a") }
	boolean := func(r *Reader, f map[string]*yaml.Node) (any, error) { return r.Bool(f["a"], "a") }
	integer := func(r *Reader, f map[string]*yaml.Node) (any, error) { return r.Int(f["a"], "a", 1, 10) }
	atLeast := func(r *Reader, f map[string]*yaml.Node) (any, error) { return r.AtLeast(f["a"], "a", 1, 10) }
	duration := func(r *Reader, f map[string]*yaml.Node) (any, error) {
		return r.Duration(f["a"], "a", time.Second, time.Hour)
	}
	for _, tc := range []struct {
		name, doc string
		read      func(*Reader, map[string]*yaml.Node) (any, error)
		want      string
	}{
		{"string", "a: x\n", str, "x"},
		{"quoted number string", "a: \"12\"\n", str, "12"},
		{"number as string", "a: 12\n", str, `1: a: "12" must be a string`},
		{"empty as string", "a:\n", str, "1: a: an empty value must be a string"},
		{"list as string", "a: [x]\n", str, "1: a: a list must be a string"},
		{"aliased string", "b: &x y\na: *x\n", str, "y"},

		{"bool", "a: false\n", boolean, "false"},
		{"quoted bool", "a: \"true\"\n", boolean, `1: a: "true" must be true or false`},
		{"word as bool", "a: maybe\n", boolean, `1: a: "maybe" must be true or false`},

		{"int", "a: 10\n", integer, "10"},
		{"int below", "a: 0\n", integer, `1: a: "0" must be a whole number from 1 to 10`},
		{"int above", "a: 11\n", integer, `1: a: "11" must be a whole number from 1 to 10`},
		{"int overflow", "a: 99999999999999999999\n", integer, `1: a: "99999999999999999999" is too large: at most 10`},
		{"quoted int overflow", "a: \"99999999999999999999\"\n", integer, `1: a: "99999999999999999999" must be a whole number from 1 to 10`},
		{"negative overflow", "a: -99999999999999999999\n", integer, `1: a: "-99999999999999999999" must be a whole number from 1 to 10`},

		{"amount", "a: 10\n", atLeast, "10"},
		{"amount below", "a: 0\n", atLeast, `1: a: "0" must be a whole number, at least 1`},
		{"amount above", "a: 11\n", atLeast, `1: a: "11" is too large: at most 10`},
		{"amount overflow", "a: +99999999999999999999\n", atLeast, `1: a: "+99999999999999999999" is too large: at most 10`},
		{"amount float", "a: 1e3\n", atLeast, `1: a: "1e3" must be a whole number, at least 1`},
		{"float as int", "a: 2.5\n", integer, `1: a: "2.5" must be a whole number from 1 to 10`},
		{"mapping as int", "a: {b: 1}\n", integer, "1: a: a mapping must be a whole number from 1 to 10"},

		{"duration", "a: 1h\n", duration, "1h0m0s"},
		{"duration at lo", "a: 1s\n", duration, "1s"},
		{"duration below", "a: 999ms\n", duration, `1: a: "999ms" must be at least 1s`},
		{"duration negative", "a: -1s\n", duration, `1: a: "-1s" must be at least 1s`},
		{"duration above", "a: 61m\n", duration, `1: a: "61m" must be at most 1h0m0s`},
		{"duration without unit", "a: 30\n", duration, `1: a: "30" must be a duration with a unit, such as 1s or 1h`},
		{"duration garbage", "a: soon\n", duration, `1: a: "soon" is not a duration; write a number and a unit (s, h)`},
		{"duration days", "a: 1d\n", duration, `1: a: "1d" is not a duration; write a number and a unit (s, h)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := read(t, tc.doc, tc.read); got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}

func TestJoin(t *testing.T) {
	for _, tc := range []struct{ path, field, want string }{
		{"", "period", "period"},
		{"limits[1]", "period", "limits[1].period"},
		{"pace.subject", "fixed", "pace.subject.fixed"},
	} {
		if got := Join(tc.path, tc.field); got != tc.want {
			t.Errorf("Join(%q, %q) = %q, want %q", tc.path, tc.field, got, tc.want)
		}
	}
}

func TestMessage(t *testing.T) {
	for _, tc := range []struct {
		name             string
		line             int
		who, field, want string
	}{
		{"file", 0, "", "", "f.yaml: reason"},
		{"line", 3, "", "", "f.yaml:3: reason"},
		{"field", 3, "", "prefix", "f.yaml:3: prefix: reason"},
		{"named", 7, "stripe", "period", `f.yaml:7: rule "stripe": period: reason`},
		{"position", 7, "#2", "name", "f.yaml:7: rule #2: name: reason"},
		{"quoted name", 1, `a"b`, "", `f.yaml:1: rule "a\"b": reason`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Message("f.yaml", tc.line, "rule", tc.who, tc.field, "reason"); got != tc.want {
				t.Errorf("got %s, want %s", got, tc.want)
			}
		})
	}
}
