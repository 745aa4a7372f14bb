package worker

import (
	"fmt"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
	"github.com/jobthrottle/jobthrottle/rules"
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
