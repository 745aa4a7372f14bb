package worker

import (
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// FromRules builds a limiter for every rule of cfg on rdb and returns the
// middleware applying them, each task's subject and cost derived from its
// payload as the rule says. opts are those of NewMiddleware; its Logger
// and its Metrics' OnRedisError also go to the limiters, and with Asynq,
// WakeOnHandoff wakes the tasks handed a place of a concurrency rule.
func FromRules(cfg *rules.Config, rdb redis.UniversalClient, opts Options) (*Middleware, error) {
	base := throttle.Options{Logger: opts.Logger}
	if opts.Metrics != nil {
		base.OnRedisError = opts.Metrics.OnRedisError
	}
	if opts.Asynq != nil {
		base.OnHandoff = WakeOnHandoff(opts.Asynq)
	}
	trs := make([]TaskRule, 0, len(cfg.Rules))
	for _, r := range cfg.Rules {
		lim, err := cfg.Limiter(rdb, r.Name, base)
		if err != nil {
			return nil, err
		}
		tr := TaskRule{Name: r.Name, Tasks: r.Tasks, Limiter: lim,
			Subject: func(t *asynq.Task) (string, error) { return r.Subject.Of(t.Payload()) },
			Cost:    func(t *asynq.Task) (int, error) { return r.Cost.Of(t.Payload()) },
			MaxWait: r.MaxWait, WaitSlots: r.WaitSlots, Horizon: r.Horizon, Weights: r.Weights}
		if r.FairBy != (rules.SubjectConfig{}) {
			tr.FairBy = func(t *asynq.Task) (string, error) { return r.FairBy.Of(t.Payload()) }
		}
		trs = append(trs, tr)
	}
	return NewMiddleware(trs, opts)
}
