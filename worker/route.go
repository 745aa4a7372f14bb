package worker

import (
	"sort"
	"strings"
)

// router finds the value a task type routes to by the rules' patterns: the
// exact type if a rule lists it, else the longest prefix pattern ("stripe:*",
// "*") that matches. The middleware and Config.RuleFor both route with it,
// so a producer and the workers always agree on a task type's rule.
type router[V any] struct {
	exact    map[string]V
	prefixes []routePrefix[V] // longest prefix first
}

type routePrefix[V any] struct {
	prefix string
	v      V
}

// add routes pattern to v. The caller rejects a pattern given twice.
func (r *router[V]) add(pattern string, v V) {
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		r.prefixes = append(r.prefixes, routePrefix[V]{prefix, v})
		sort.SliceStable(r.prefixes, func(i, j int) bool { return len(r.prefixes[i].prefix) > len(r.prefixes[j].prefix) })
		return
	}
	if r.exact == nil {
		r.exact = map[string]V{}
	}
	r.exact[pattern] = v
}

// lookup returns the value taskType routes to, and false if none.
func (r *router[V]) lookup(taskType string) (V, bool) {
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
