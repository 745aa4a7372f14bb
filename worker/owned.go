package worker

import (
	"io"
	"sync"
	"sync/atomic"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// ruleUse counts the tasks using a rule's gate and limiter, so that a
// limiter the worker built itself (FromRules, Reload) is closed once the
// rule is retired (replaced by Reload, or by Drain) and no task uses it
// any longer: a task admitted under the old rule keeps its limiter, and
// the place it may hold there, until its handler returns. A limiter given
// to NewMiddleware is the user's: owned is nil and nothing is closed.
type ruleUse struct {
	owned   io.Closer // the limiter to close; nil if the user's
	tasks   atomic.Int64
	retired atomic.Bool
	once    sync.Once
}

// acquire counts one more task using the rule, unless the rule is retired
// (it reports false then, and counts nothing).
func (u *ruleUse) acquire() bool {
	u.tasks.Add(1)
	if u.retired.Load() {
		u.done()
		return false
	}
	return true
}

// done counts a task acquire counted as no longer using the rule, and
// closes the owned limiter if it was the last of a retired rule.
func (u *ruleUse) done() {
	if u.tasks.Add(-1) == 0 && u.retired.Load() {
		u.close()
	}
}

// retire takes the rule out of use: acquire fails from now on, and the
// owned limiter is closed at once if no task uses it, else when the last
// one is done.
func (u *ruleUse) retire() {
	if u.owned == nil {
		return // the user's limiter: the rule stays in use
	}
	u.retired.Store(true)
	if u.tasks.Load() == 0 {
		u.close()
	}
}

// close closes the owned limiter, once.
func (u *ruleUse) close() {
	if u.owned != nil {
		u.once.Do(func() { _ = u.owned.Close() })
	}
}

// use returns the rule for a task type, counted as used by one more task
// (call its done when the task's handler returns), or nil if no rule
// applies. It reports false, with the rule, uncounted, once the middleware
// is drained and the rule retired with it.
func (m *Middleware) use(taskType string) (*ruleGate, bool) {
	for {
		r := m.rule(taskType)
		if r == nil || r.acquire() {
			return r, true
		}
		if m.drainCtx.Err() != nil && m.table.Load().byName[r.Name] == r {
			return r, false
		}
		// Retired by a Reload just now: take the new table's rule.
	}
}

// own marks the limiters of t's rules as the worker's to close (FromRules,
// Reload built them).
func (t *ruleTable) own() {
	for _, r := range t.byName {
		if lim, ok := r.Limiter.(*throttle.Limiter); ok {
			r.owned = lim
		}
	}
}

// closeLimiters closes the limiters of trs, built for rules that did not
// come into force.
func closeLimiters(trs []TaskRule) {
	for _, tr := range trs {
		if lim, ok := tr.Limiter.(*throttle.Limiter); ok {
			_ = lim.Close()
		}
	}
}

// retireAll retires every rule of t (Reload replaced t, or Drain).
func retireAll(t *ruleTable) {
	for _, r := range t.byName {
		r.retire()
	}
}
