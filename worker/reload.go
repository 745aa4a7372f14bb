package worker

import (
	"errors"
	"fmt"

	"github.com/jobthrottle/jobthrottle/rules"
)

// Reload replaces the middleware's rules with cfg's while tasks run: a
// rules file changed on disk (cmd/worker reloads it on SIGHUP). It builds
// every limiter and gate of cfg first; if one fails, or if cfg cannot
// replace the rules in force (rules.Config.CheckChange: another prefix, a
// limit whose algorithm, or whose fixed window's period, changed under the
// same name), it returns an error naming the rule and field, and changes
// nothing. Otherwise it swaps the rules at once:
//
//   - A task that arrives after Reload takes the new rule of its type; a
//     task already being admitted, waiting or running keeps the rule it
//     started under, and gives back a place of a concurrency rule through
//     the limiter that granted it.
//   - A limit's keys depend on the prefix, the subject and the limit's
//     name only, so its state in Redis carries over: the bookings made
//     under the old limit are kept (a parked task redeems its turn when it
//     comes back), and new bookings follow the new limit.
//   - A rule that cfg adds applies to the next task of its types; the
//     task types of a rule that cfg removes are no longer throttled, as
//     for any type no rule matches.
//
// A rule's wait_slots count afresh on its new gate; Options.MaxWaiting
// keeps counting across reloads. Each old limiter is closed
// (throttle.Limiter.Close) once the last task admitted under it has
// returned: one still running keeps its place renewed until then. A
// drained middleware refuses to reload. Options (Logger, Metrics, Asynq, MaxWaiting, RedisRetryDelay)
// stay as given. Reload needs a Middleware built by FromRules; calls are
// serialized.
func (m *Middleware) Reload(cfg *rules.Config) error {
	src := m.source
	switch {
	case src == nil:
		return errors.New("worker: Reload: the middleware was not built by FromRules, so it has no rules file to reload; build it with FromRules")
	case cfg == nil:
		return errors.New("worker: Reload: nil rules")
	}
	src.mu.Lock()
	defer src.mu.Unlock()
	err := src.cfg.CheckChange(cfg)
	var trs []TaskRule
	if err == nil {
		trs, err = src.taskRules(cfg)
	}
	var t *ruleTable
	if err == nil {
		t, err = m.newTable(trs)
	}
	if err != nil {
		closeLimiters(trs)
		return fmt.Errorf("worker: reload refused: %w", err)
	}
	if m.drainCtx.Err() != nil {
		closeLimiters(trs)
		return errors.New("worker: reload refused: the middleware is drained")
	}
	t.own()
	old := m.table.Load()
	for name, r := range t.byName {
		if o := old.byName[name]; o != nil && o.stacked.Load() {
			// A rule found stacked stays so (admit.go): relearning it
			// would first send a few tasks to the back of its line.
			r.stacked.Store(true)
		}
	}
	// A sweep or serving scheduled before now runs on the rule's new
	// gate, whose keys are the old one's; a removed rule's are dropped,
	// unless a middleware stacked with this one has a rule of that name.
	m.swap(t)
	// Each old limiter is closed once no task admitted under it is left.
	retireAll(old)
	src.cfg = cfg
	src.publish(m.log, trs)
	return nil
}
