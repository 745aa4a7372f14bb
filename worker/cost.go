package worker

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/hibiken/asynq"
)

// Cost says how many permits a task takes from its rule: the emails of a
// batch, the rows of an import. An error means the task can never be
// admitted: the middleware archives it at once with the reason, as for a
// subject it cannot derive. A cost of 0 runs the task without charging the
// rule.
type Cost func(*asynq.Task) (int, error)

// MaxCost bounds a cost, whatever its source.
const MaxCost = 1 << 30

// FixedCost returns a Cost of n permits for every task.
func FixedCost(n int) Cost {
	return func(*asynq.Task) (int, error) { return n, nil }
}

// PayloadCost returns a Cost read from the top-level field name of the
// task's JSON object payload: a whole number from 0 to MaxCost. A missing
// field, another type, a fraction or a number out of range is an error.
func PayloadCost(name string) Cost {
	return func(t *asynq.Task) (int, error) {
		return payloadCost(t.Payload(), name)
	}
}

func payloadCost(payload []byte, name string) (int, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(payload, &fields); err != nil || fields == nil {
		return 0, fmt.Errorf("payload is not a JSON object, so it has no cost field %q", name)
	}
	raw, ok := fields[name]
	if !ok {
		return 0, fmt.Errorf("payload has no cost field %q", name)
	}
	raw = bytes.TrimSpace(raw)
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		what := kind(raw)
		if len(raw) > 0 && (raw[0] == '-' || '0' <= raw[0] && raw[0] <= '9') {
			what = string(raw)
		}
		return 0, fmt.Errorf("payload cost field %q is %s; want a whole number of permits", name, what)
	}
	if n < 0 || n > MaxCost {
		return 0, fmt.Errorf("payload cost field %q is %d; want 0 to %d permits", name, n, MaxCost)
	}
	return int(n), nil
}

// cost returns the task's cost under r: 1 if r has no Cost.
func (r *Rule) cost(task *asynq.Task) (int, error) {
	if r.Cost == nil {
		return 1, nil
	}
	n, err := r.Cost(task)
	if err == nil && (n < 0 || n > MaxCost) {
		err = fmt.Errorf("cost %d is out of range; want 0 to %d permits", n, MaxCost)
	}
	return n, err
}
