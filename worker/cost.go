package worker

import (
	"fmt"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Cost says how many permits a task takes from its rule: the emails of a
// batch, the rows of an import. An error means the task can never be
// admitted: the middleware archives it at once with the reason, as for a
// subject it cannot derive. A cost of 0 runs the task without charging the
// rule.
type Cost func(*asynq.Task) (int, error)

// FixedCost returns a Cost of n permits for every task.
func FixedCost(n int) Cost {
	return func(*asynq.Task) (int, error) { return n, nil }
}

// PayloadCost returns a Cost read from the top-level field name of the
// task's JSON object payload: a whole number from 0 to rules.MaxCost. A missing
// field, another type, a fraction or a number out of range is an error.
func PayloadCost(name string) Cost {
	return func(t *asynq.Task) (int, error) {
		return jsonpayload.Cost(t.Payload(), name)
	}
}

// Costs says what a task takes under each rule of its rule's limiter, in
// the order of the limiter's rules (TaskRule.Costs). An error archives
// the task, as for Cost.
type Costs func(*asynq.Task) (throttle.Costs, error)

// costs returns the task's costs under r and their largest, nil and 0 if
// r has no Costs.
func (r *TaskRule) costs(task *asynq.Task) (throttle.Costs, int, error) {
	if r.Costs == nil {
		return nil, 0, nil
	}
	c, err := r.Costs(task)
	if err != nil {
		return nil, 0, err
	}
	most := 0
	for _, n := range c {
		if n < 0 || n > rules.MaxCost {
			return nil, 0, fmt.Errorf("cost %d is out of range; want 0 to %d permits", n, rules.MaxCost)
		}
		most = max(most, n)
	}
	return c, most, nil
}

// cost returns the task's cost under r: 1 if r has no Cost.
func (r *TaskRule) cost(task *asynq.Task) (int, error) {
	if r.Cost == nil {
		return 1, nil
	}
	n, err := r.Cost(task)
	if err == nil && (n < 0 || n > rules.MaxCost) {
		err = fmt.Errorf("cost %d is out of range; want 0 to %d permits", n, rules.MaxCost)
	}
	return n, err
}
