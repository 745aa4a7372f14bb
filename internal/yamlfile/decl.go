package yamlfile

import (
	"time"

	"go.yaml.in/yaml/v3"
)

// A file's mappings are read from declarations: each mapping's fields are
// listed once, as Fields, with whether each is required and how its value
// is read into the value being built. Reader.Fields then refuses the keys
// not declared, reports a missing required field, and reads the others in
// the order declared:
//
//	sc := Schedule{MaxRetry: -1}
//	_, err := r.Fields(n, "", "a schedule", []yamlfile.Field{
//		{Key: "type", Missing: "give the asynq task type", Read: r.StrTo(&sc.Type)},
//		{Key: "max_retry", Read: r.IntTo(&sc.MaxRetry, 0, 1000)},
//	})
//
// What ties fields together (one excludes another, a default that
// depends on a third) stays in code after the call.

// ReadFunc reads the value n of the field at path field, storing it where
// it was bound, and returns the error to report, if any.
type ReadFunc func(n *yaml.Node, field string) error

// Field declares one field of a mapping.
type Field struct {
	Key string
	// Missing, if not "", makes the field required: a mapping without it
	// fails at the mapping's line with "missing; " + Missing.
	Missing string
	// Read reads the field's value, if present; nil leaves it to the code
	// after Fields (which finds its node in the map Fields returns).
	Read ReadFunc
	// Check, if not nil, runs after Read (or in its place if the field is
	// absent): what ties the field to those declared before it, checked
	// in the order of the declarations.
	Check func() error
}

// Fields reads the mapping at n (path names it in field paths, what in
// reasons, as for Mapping) as decl declares: the keys allowed are decl's,
// in its order; in decl's order, each field present is read by its Read, a
// required one missing fails, and each Check runs. It returns the mapping's values by
// key, for the checks that tie fields together.
func (r *Reader) Fields(n *yaml.Node, path, what string, decl []Field) (map[string]*yaml.Node, error) {
	keys := make([]string, len(decl))
	for i, f := range decl {
		keys[i] = f.Key
	}
	fields, err := r.Mapping(n, path, what, keys)
	if err != nil {
		return nil, err
	}
	for _, f := range decl {
		v := fields[f.Key]
		switch {
		case v == nil && f.Missing != "":
			return nil, r.Failf(Resolve(n), Join(path, f.Key), "missing; %s", f.Missing)
		case v != nil && f.Read != nil:
			if err := f.Read(v, Join(path, f.Key)); err != nil {
				return nil, err
			}
		}
		if f.Check != nil {
			if err := f.Check(); err != nil {
				return nil, err
			}
		}
	}
	return fields, nil
}

// Into binds read, a reader of one value, to dst: the value read is
// stored there.
func Into[T any](dst *T, read func(n *yaml.Node, field string) (T, error)) ReadFunc {
	return func(n *yaml.Node, field string) error {
		v, err := read(n, field)
		if err == nil {
			*dst = v
		}
		return err
	}
}

// StrTo reads a string (Str) into dst.
func (r *Reader) StrTo(dst *string) ReadFunc { return Into(dst, r.Str) }

// BoolTo reads true or false (Bool) into dst.
func (r *Reader) BoolTo(dst *bool) ReadFunc { return Into(dst, r.Bool) }

// IntTo reads a whole number from lo to hi (Int) into dst.
func (r *Reader) IntTo(dst *int, lo, hi int64) ReadFunc {
	return Into(dst, func(n *yaml.Node, field string) (int, error) { return r.Int(n, field, lo, hi) })
}

// DurationTo reads a duration from lo to hi (Duration) into dst.
func (r *Reader) DurationTo(dst *time.Duration, lo, hi time.Duration) ReadFunc {
	return Into(dst, func(n *yaml.Node, field string) (time.Duration, error) { return r.Duration(n, field, lo, hi) })
}
