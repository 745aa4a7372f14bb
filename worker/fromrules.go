package worker

import (
	"sync"

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
// Reload replaces the rules with those of a changed file.
func FromRules(cfg *rules.Config, rdb redis.UniversalClient, opts Options) (*Middleware, error) {
	src := &ruleSource{rdb: rdb, cfg: cfg, base: throttle.Options{Logger: opts.Logger}}
	if opts.Metrics != nil {
		src.base.OnRedisError = opts.Metrics.OnRedisError
	}
	if opts.Asynq != nil {
		src.base.OnHandoff = WakeOnHandoff(opts.Asynq)
	}
	trs, err := src.taskRules(cfg)
	if err != nil {
		return nil, err
	}
	m, err := NewMiddleware(trs, opts)
	if err != nil {
		return nil, err
	}
	m.source = src
	return m, nil
}

// ruleSource is what FromRules built a middleware's rules from, for
// Reload to build the next ones alike.
type ruleSource struct {
	rdb  redis.UniversalClient
	base throttle.Options // the limiters' Logger, OnRedisError and OnHandoff

	mu  sync.Mutex    // one Reload at a time
	cfg *rules.Config // the rules in force
}

// taskRules builds a TaskRule, with its limiter, for every rule of cfg.
func (s *ruleSource) taskRules(cfg *rules.Config) ([]TaskRule, error) {
	trs := make([]TaskRule, 0, len(cfg.Rules))
	for _, r := range cfg.Rules {
		lim, err := cfg.Limiter(s.rdb, r.Name, s.base)
		if err != nil {
			return nil, err
		}
		tr := TaskRule{Name: r.Name, Tasks: r.Tasks, Limiter: lim,
			Subject: func(t *asynq.Task) (string, error) { return r.Subject.Of(t.Payload()) },
			Cost:    func(t *asynq.Task) (int, error) { return r.Cost.Of(t.Payload()) },
			MaxWait: r.MaxWait, WaitSlots: r.WaitSlots, Horizon: r.Horizon, Weights: r.Weights, ShareLimit: r.ShareLimit}
		if r.FairBy != (rules.SubjectConfig{}) {
			tr.FairBy = func(t *asynq.Task) (string, error) { return r.FairBy.Of(t.Payload()) }
		}
		trs = append(trs, tr)
	}
	return trs, nil
}
