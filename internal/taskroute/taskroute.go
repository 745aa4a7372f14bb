// Package taskroute finds the rule a task type takes: the rule listing the
// exact type, else the one with the longest matching prefix pattern
// ("stripe:*", "*"). The rules file (rules.Config.RuleFor) and the worker
// middleware both route with it, so a producer and the workers always
// agree on a task type's rule.
//
// Imports: the standard library only.
package taskroute

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

// Router finds the value a task type routes to by the rules' patterns.
// The zero value routes nothing.
type Router[V any] struct {
	exact    map[string]V
	prefixes []prefix[V] // longest prefix first
}

type prefix[V any] struct {
	prefix string
	v      V
}

// Add routes pattern to v. The caller rejects a pattern given twice
// (CheckPattern checks one pattern alone).
func (r *Router[V]) Add(pattern string, v V) {
	if p, ok := strings.CutSuffix(pattern, "*"); ok {
		r.prefixes = append(r.prefixes, prefix[V]{p, v})
		sort.SliceStable(r.prefixes, func(i, j int) bool { return len(r.prefixes[i].prefix) > len(r.prefixes[j].prefix) })
		return
	}
	if r.exact == nil {
		r.exact = map[string]V{}
	}
	r.exact[pattern] = v
}

// Lookup returns the value taskType routes to, and false if none.
func (r *Router[V]) Lookup(taskType string) (V, bool) {
	if v, ok := r.exact[taskType]; ok {
		return v, true
	}
	for _, p := range r.prefixes {
		if strings.HasPrefix(taskType, p.prefix) {
			return p.v, true
		}
	}
	var zero V
	return zero, false
}

// CheckPattern reports whether p is a valid task type or pattern: not
// empty, and no '*' but at its end.
func CheckPattern(p string) error {
	switch {
	case p == "":
		return errors.New(`pattern "" is empty; give a task type such as "email:send" or a prefix pattern such as "stripe:*"`)
	case strings.Contains(strings.TrimSuffix(p, "*"), "*"):
		return fmt.Errorf(`pattern %q: '*' may only end a pattern, as in "stripe:*"`, p)
	}
	return nil
}
