package worker

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Reserve, then settle. A rule with a Cost charges it before the handler
// runs; for a cost known only afterwards (the tokens an LLM call used),
// that charge is an estimate, and the handler reports the real cost with
// SetCost. When the handler returns, the middleware settles the rule's
// turn to it (throttle.Reservation.Settle): the difference is given back,
// or charged, into debt if need be, atomically on the Redis clock.

// SetCost reports the real cost of the running task, in permits, for the
// rules that charged it an estimate (a Rule with a Cost): when the handler
// returns, each such rule's turn is settled to n, once, whatever the
// handler returns. The last call counts. A handler that never calls it
// keeps the estimate. A rule without a Cost charges one permit per task
// and is not settled.
//
// Limits of different costs for one task type, such as requests per minute
// (one per task) beside tokens per minute (an estimate, settled), are two
// rules in two middlewares, mux.Use(tokens.Wrap) then mux.Use(requests.Wrap):
// the tokens rule has a Cost, the requests rule none. A task that an inner
// middleware parks or defers does not run, so the outer rule's turn is
// given back (settled to 0) and the task takes a new one when it returns.
//
// It returns an error if n is negative or more than rules.MaxCost, or if ctx is
// not a handler's context under a Middleware.
func SetCost(ctx context.Context, n int) error {
	rep, ok := ctx.Value(costKey{}).(*costReport)
	switch {
	case !ok:
		return fmt.Errorf("worker: SetCost: the context is not a task's under a Middleware; nothing will be settled")
	case n < 0 || n > rules.MaxCost:
		return fmt.Errorf("worker: SetCost: cost %d is out of range; want 0 to %d permits", n, rules.MaxCost)
	}
	rep.mu.Lock()
	defer rep.mu.Unlock()
	rep.cost, rep.set = n, true
	return nil
}

// SetCosts reports the real costs of the running task under each rule of
// its rule's limiter, in the order of the limiter's rules, for a rule
// with Costs (TaskRule.Costs): when the handler returns, the turn is
// settled to them, each rule given back or charged its own difference, in
// one call (throttle.Reservation.SettleCosts). The last call counts. It
// returns SetCost's errors for a cost out of range or a context not under
// a Middleware.
func SetCosts(ctx context.Context, c throttle.Costs) error {
	rep, ok := ctx.Value(costKey{}).(*costReport)
	if !ok {
		return fmt.Errorf("worker: SetCosts: the context is not a task's under a Middleware; nothing will be settled")
	}
	for _, n := range c {
		if n < 0 || n > rules.MaxCost {
			return fmt.Errorf("worker: SetCosts: cost %d is out of range; want 0 to %d permits", n, rules.MaxCost)
		}
	}
	rep.mu.Lock()
	defer rep.mu.Unlock()
	rep.costs = slices.Clone(c)
	return nil
}

// costReport is what the handler of one task reported, shared by every
// Middleware that wraps it (the outermost makes it).
type costReport struct {
	mu      sync.Mutex
	cost    int
	set     bool           // SetCost was called
	costs   throttle.Costs // SetCosts's, nil if it was not called
	skipped bool           // a middleware did not run the handler (parked, deferred)
}

type costKey struct{}

// withCostReport returns ctx with the task's costReport, made here if no
// outer middleware made it.
func withCostReport(ctx context.Context) (context.Context, *costReport) {
	if rep, ok := ctx.Value(costKey{}).(*costReport); ok {
		return ctx, rep
	}
	rep := &costReport{}
	return context.WithValue(ctx, costKey{}, rep), rep
}

// notRun records that the handler will not run this time.
func (r *costReport) notRun() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.skipped = true
}

// wasSkipped reports whether a middleware did not run the handler this
// time (notRun): one inside the caller's, if the caller's ran it.
func (r *costReport) wasSkipped() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.skipped
}

// actual returns the cost to settle a turn of rule r to (with
// TaskRule.Costs, the costs per rule if SetCosts gave them), and false to
// keep the turn as charged.
func (r *costReport) actual(rule *ruleGate) (int, throttle.Costs, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.skipped:
		return 0, nil, true
	case r.costs != nil && rule.Costs != nil:
		return 0, r.costs, true
	case r.set && rule.Cost != nil:
		return r.cost, nil, true
	}
	return 0, nil, false
}

// settle corrects the task's turn under r once its handler has returned:
// to the cost the handler reported, or to 0 if an inner middleware did
// not run it. A failure is logged: the turn then keeps its estimate.
func (m *Middleware) settle(ctx context.Context, r *ruleGate, task *asynq.Task, w turn, rep *costReport) {
	actual, per, ok := rep.actual(r)
	if !ok || w.res == nil || (per == nil && w.costs == nil && actual == w.cost) {
		return
	}
	// The handler's ctx may have ended: bounded as the limiter bounds what
	// it gives back, so that a settle Redis loses is reported to its
	// OnRedisError.
	sctx, cancel := r.gate.Limiter().Detach(ctx)
	defer cancel()
	id, _ := asynq.GetTaskID(ctx)
	log := m.log.With("rule", r.Name, "task_id", id, "task_type", task.Type(), "subject", w.Subject)
	var err error
	if per != nil {
		err = w.res.SettleCosts(sctx, per)
	} else {
		err = w.res.Settle(sctx, actual)
	}
	if err != nil {
		log.WarnContext(ctx, "worker: cannot settle the task's cost; its estimate stays charged", "estimate", w.estimate(), "actual", costText(actual, per), "error", err)
		return
	}
	log.DebugContext(ctx, "worker: settled the task's cost", "estimate", w.estimate(), "actual", costText(actual, per))
}

// estimate is the cost w took, for logs: its costs per rule, or its cost.
func (w turn) estimate() string { return costText(w.cost, w.costs) }

// costText is a cost for logs: per, "1 900 400", if not nil, else n.
func costText(n int, per throttle.Costs) string {
	if per == nil {
		return strconv.Itoa(n)
	}
	return strings.Trim(fmt.Sprint([]int(per)), "[]")
}
