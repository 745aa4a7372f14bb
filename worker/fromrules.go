package worker

import (
	"cmp"
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// FromRules builds a limiter for every rule of cfg on rdb and returns the
// middleware applying them (its limiters, which Drain and Close close), each task's subject and cost derived from its
// payload as the rule says. opts are those of NewMiddleware; its Logger
// and its Metrics' OnRedisError also go to the limiters, and with Asynq,
// WakeOnHandoff wakes the tasks handed a place of a concurrency rule.
// Reload replaces the rules with those of a changed file.
//
// FromRules, and Reload after it, publish the limit of every throttle rule
// they charge (admission.PublishLimits) under cfg's prefix, so that a
// producer pacing under another limit is refused (enqueue.PaceSpec); a
// failure to publish is logged as a warning, not returned.
func FromRules(cfg *rules.Config, rdb redis.UniversalClient, opts Options) (*Middleware, error) {
	src := &ruleSource{rdb: rdb, cfg: cfg, base: throttle.Options{Logger: opts.Logger}}
	if opts.Metrics != nil {
		src.base.OnRedisError = opts.Metrics.OnRedisError
	}
	if opts.Asynq != nil {
		src.base.OnHandoff = wakeOnHandoff(opts.Asynq, opts.WakeupShards)
	}
	trs, err := src.taskRules(cfg)
	if err != nil {
		return nil, err
	}
	m, err := NewMiddleware(trs, opts)
	if err != nil {
		closeLimiters(trs)
		return nil, err
	}
	m.table.Load().own() // before any task: Drain closes them
	m.source = src
	src.publish(m.log, trs)
	return m, nil
}

// publishTimeout bounds publishing the rules' limits, which a worker does
// not wait on for long: a Redis that does not answer now fails the tasks'
// own calls soon enough, and says so there.
const publishTimeout = 2 * time.Second

// publish records the limits of trs' rules for producers to check theirs
// against (admission.PublishLimits). A failure is logged, not returned: it
// costs only the producers' check, not the workers' limits.
func (s *ruleSource) publish(log *slog.Logger, trs []TaskRule) {
	var rules []throttle.Rule
	seen := map[string]bool{}
	for _, tr := range trs {
		lim, ok := tr.Limiter.(*throttle.Limiter)
		if !ok {
			continue
		}
		for _, r := range lim.Rules() {
			if !seen[r.Name] {
				seen[r.Name] = true
				rules = append(rules, r)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	prefix := cmp.Or(s.cfg.Prefix, throttle.DefaultPrefix)
	if err := admission.PublishLimits(ctx, s.rdb, prefix, rules); err != nil {
		log.Warn("worker: producers cannot check their limits against this worker's", "err", err)
	}
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
			closeLimiters(trs)
			return nil, err
		}
		tr := TaskRule{Name: r.Name, Tasks: r.Tasks, Limiter: lim,
			Subject:  func(t *asynq.Task) (string, error) { return r.Subject.Of(t.Payload()) },
			Cost:     func(t *asynq.Task) (int, error) { return r.Cost.Of(t.Payload()) },
			Settings: r.Settings, Within: r.Within}
		if r.Nested {
			tr.Within = "" // decided under both rules' limits by its own limiter (rules.RuleConfig.Nested)
		}
		if r.LimitCosts != nil {
			tr.Cost, tr.Costs = nil, func(t *asynq.Task) (throttle.Costs, error) { return r.Costs(t.Payload()) }
		}
		if r.Priority.PayloadField != "" || r.Priority.Queues != nil {
			tr.Priority = func(ctx context.Context, t *asynq.Task) (int, error) {
				q, _ := asynq.GetQueueName(ctx)
				return r.Priority.Of(t.Payload(), q)
			}
		}
		if r.FairBy != (rules.SubjectConfig{}) {
			tr.FairBy = func(t *asynq.Task) (string, error) { return r.FairBy.Of(t.Payload()) }
		}
		trs = append(trs, tr)
	}
	return trs, nil
}
