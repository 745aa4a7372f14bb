package worker

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Stacked rules in one middleware (TaskRule.Within): a task of a rule
// within others is admitted under all of them by one admission.Stack, so
// that it holds a turn of each when it runs and parks once, on the slower
// limit, instead of taking a turn of one rule and giving it back each time
// another parks it.

// stackRules resolves each rule's Within, outward, and builds its stack.
// Rules are taken in name order, so that an error names the same rule
// every time.
func (t *ruleTable) stackRules() error {
	for _, name := range slices.Sorted(maps.Keys(t.byName)) {
		r := t.byName[name]
		if r.Within == "" {
			continue
		}
		seen := map[string]bool{name: true}
		gates := []*admission.Gate{r.gate}
		for o := r; o.Within != ""; {
			next := t.byName[o.Within]
			switch {
			case next == nil:
				return ruleError(o.Name, "within", fmt.Sprintf("no rule is named %q", o.Within))
			case seen[next.Name]:
				return ruleError(name, "within", fmt.Sprintf("rule %q comes back to a rule it is within", o.Name))
			}
			seen[next.Name] = true
			r.within = append(r.within, next)
			gates = append(gates, next.gate)
			o = next
		}
		for i, g := range gates {
			if g == nil {
				rule := r
				if i > 0 {
					rule = r.within[i-1]
				}
				return ruleError(rule.Name, "within", "stacked rules need a *throttle.Limiter each: a task parks on their booked turns")
			}
		}
		var err error
		if r.stack, err = admission.NewStack(gates...); err != nil {
			return ruleError(name, "within", err.Error())
		}
	}
	return nil
}

// useWithin counts one more task using each rule r is within, and reports
// false (counting nothing) if one is retired (drained).
func (r *ruleGate) useWithin() bool {
	for i, o := range r.within {
		if !o.acquire() {
			for _, done := range r.within[:i] {
				done.done()
			}
			return false
		}
	}
	return true
}

// doneWithin counts a task useWithin counted as done.
func (r *ruleGate) doneWithin() {
	for _, o := range r.within {
		o.done()
	}
}

// held returns the turns a task admitted under r holds: r's, then those
// of the rules it is within.
func (t turn) held(r *ruleGate) []ruleTurn {
	return append([]ruleTurn{{rule: r, turn: t}}, t.within...)
}

// admitStacked is admit for a task of a rule within others: the task's
// request to each rule (its subject and cost there, as its taskRun), one
// decision over all of them, and the turns it holds, or the park on the
// rule that parked it.
func (m *Middleware) admitStacked(ctx context.Context, t *taskRun) (turn, error) {
	r := t.rule
	runs := []*taskRun{t}
	for _, o := range r.within {
		ot, err := m.newTaskRun(ctx, o, t.task)
		if err != nil {
			m.metrics.decided(o.Name, admission.LabelError)
			return turn{}, err
		}
		runs = append(runs, ot)
	}
	reqs := make([]admission.Request, len(runs))
	for i, rt := range runs {
		if rt.Cost == 0 {
			continue // free under this rule: the zero Request takes no turn
		}
		if err := m.gateRequest(ctx, rt); err != nil {
			m.metrics.decided(rt.rule.Name, admission.LabelError)
			return turn{}, err
		}
		if i > 0 {
			rt.Receipt = "" // a producer's receipt is the task's own rule's
		}
		reqs[i] = rt.Request
	}
	if t.lastAttempt && m.requeue == nil {
		return m.waitInPlaceStacked(ctx, runs)
	}
	wctx, done := m.waitContext(ctx, t)
	defer done()
	for _, rt := range runs {
		m.metrics.waiting(rt.rule.Name, 1)
		defer m.metrics.waiting(rt.rule.Name, -1)
	}
	sd, err := r.stack.Admit(wctx, reqs)
	switch {
	case err != nil:
		return turn{}, m.notAdmitted(ctx, wctx, runs[sd.Gate], err)
	case sd.Outcome == admission.Park:
		return turn{}, m.park(ctx, runs[sd.Gate], sd.Decision)
	}
	turns := make([]turn, len(runs))
	for i, rt := range runs {
		d := sd.Turns[i]
		w := admission.Wait{Rule: rt.rule.Name, Subject: rt.Subject, Duration: d.Waited, Redeemed: d.Status == throttle.Redeemed, Turn: d.Slot}
		m.admitted(rt, w)
		turns[i] = turn{Wait: w, place: d.Place, res: d.Reservation, cost: rt.Cost}
	}
	own := turns[0]
	for i, o := range r.within {
		own.within = append(own.within, ruleTurn{rule: o, turn: turns[i+1]})
	}
	return own, nil
}

// waitInPlaceStacked admits a task on its last attempt without
// Options.Asynq under each of its rules in turn, waiting in its handler;
// the places taken before a rule that fails are released.
func (m *Middleware) waitInPlaceStacked(ctx context.Context, runs []*taskRun) (turn, error) {
	turns := make([]turn, 0, len(runs))
	for _, rt := range runs {
		w, place, err := m.waitInPlace(ctx, rt)
		if err != nil {
			for i, h := range turns {
				if h.place != nil {
					m.release(runs[i].rule, h.place, h.Wait)
				}
			}
			return turn{}, err
		}
		turns = append(turns, turn{Wait: w, place: place})
	}
	own := turns[0]
	for i, o := range runs[0].rule.within {
		own.within = append(own.within, ruleTurn{rule: o, turn: turns[i+1]})
	}
	return own, nil
}
