// Package rules owns the rules file: the limits a worker fleet applies to
// each task type, parsed and validated with line-numbered errors. The
// workers (package worker, cmd/worker), the handlers (package handler,
// which reads the file's handlers section) and the producers that pace at
// the source (package enqueue, cmd/enqueue) all read the same file with
// it, so they cannot disagree on a rule, its subject, its cost or its
// Redis keys.
//
//	cfg, err := rules.Load("rules.yaml")
//	if err != nil {
//		return err // rules.yaml:7: rule "stripe": period: "0s" must be at least 1µs
//	}
//	rc, ok := cfg.RuleFor("stripe:charge")        // the rule of a task type
//	lim, err := cfg.Limiter(rdb, rc.Name, throttle.Options{})
//	subject, err := rc.Subject.Of(payload)        // as the workers derive it
//
// Error is the one error type of jobthrottle's files: this one, its
// handlers section and cmd/enqueue's schedules file.
//
// Imports: throttle, admission (for admission.Settings, a rule's admission
// settings, declared there once), go-redis and the YAML parser; it must not
// import asynq, worker, enqueue or handler.
package rules

import (
	"fmt"
	"os"

	"github.com/redis/go-redis/v9"
	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
	"github.com/jobthrottle/jobthrottle/internal/llmusage"
	"github.com/jobthrottle/jobthrottle/internal/taskroute"
	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// handlersField is the rules file's section that package handler reads
// (what runs each task type); Parse only lets it through.
const handlersField = "handlers"

// Config is a parsed rules file (see README.md for the format):
//
//	prefix: "jobthrottle:"
//	fail_open: false
//	rules:
//	  - name: stripe
//	    tasks: ["stripe:*"]
//	    subject: {payload_field: account_id}
//	    algorithm: gcra
//	    limit: 20
//	    period: 1s
//	    max_wait: 30s
//
// Parse and Load return only valid configs: every limit has
// passed throttle.Rule.Validate.
type Config struct {
	// File is the name the config was parsed under, used in messages.
	File string
	// Prefix starts every Redis key. throttle.DefaultPrefix if the file has none.
	Prefix string
	// FailOpen admits tasks while Redis cannot be reached (throttle.Options.FailOpen).
	FailOpen bool
	// Budgets are named limits that several rules may share (a rule's
	// budget, or a policy limit's): their keys are <prefix>{<subject>}:<name>,
	// so every rule drawing on a budget, whatever its task types, charges
	// the same ledger for the same subject.
	Budgets []throttle.Rule
	// Rules in file order.
	Rules []RuleConfig

	handlers *yaml.Node // the handlers section as read; nil if none
}

// HandlersSection returns the file's handlers section as read, which
// package handler parses (handler.FromRules), or nil if the file has
// none: a worker reads its rules file once for both.
func (c *Config) HandlersSection() *yaml.Node { return c.handlers }

// RuleConfig is one rule of a rules file.
type RuleConfig struct {
	Name    string
	Tasks   []string      // task types and prefix patterns ("stripe:*")
	Subject SubjectConfig // what the rule limits
	// Limits are the rule's limits, checked and charged together in one
	// atomic call (a policy). A rule with a single limit has one, named
	// as the rule; a policy's limits are named "<rule>.<limit>". The names
	// are the last part of the Redis keys: <prefix>{<subject>}:<name>.
	Limits []throttle.Rule
	Cost   CostConfig // permits per task; the zero value is one
	// LimitCosts, if not nil, is the cost of each of Limits (a policy
	// whose limits have a cost field of their own: an LLM call's
	// requests, input tokens and output tokens), in their order; a limit
	// without one takes one permit. Cost is then unset. Costs reads them.
	LimitCosts []CostConfig
	// FairBy, if set (either field), divides the rule's limit among the
	// shares of each subject with tasks waiting (worker.TaskRule.FairBy),
	// weighed by Settings.Weights and each limited by Settings.ShareLimit.
	FairBy SubjectConfig
	// Priority, if set (either field), orders the tasks waiting in each
	// subject's line by level, 0 to admission.MaxPriority, higher first
	// (worker.TaskRule.Priority); its max_age is Settings.MaxAge.
	Priority PriorityConfig
	// Within, if set, names another rule of the file whose limits also
	// hold for this rule's tasks, over that rule's own subject and cost (a
	// per-key rule within a per-tenant one, worker.TaskRule.Within).
	Within string
	// Nested (nested: true, with Within) says that each subject of the
	// rule belongs to one subject of the rule it is within (an API key to
	// its tenant). Parse then makes its tasks the outer rule's, shared out
	// by this rule's subject: Subject becomes the outer rule's, FairBy
	// this rule's own, ShareLimit its one limit (gcra or token_bucket) and
	// Limits the outer rule's (the same keys: the tenant's limit is the
	// one its own tasks use). Each key is then a share of the tenant's
	// line, limited on its own there, and one atomic call decides a task
	// under both limits (throttle.AdmitRequest.ShareLimit): a task parks
	// once. Its limiter keeps a line of its own (throttle.Options.Line:
	// the rule's name), apart from the outer rule's tasks'. A key is
	// limited within its tenant: a key that two tenants' tasks name has a
	// limit under each. Within is kept, for --check; the worker does not
	// stack a nested rule.
	Nested bool
	// Settings are how the rule's tasks are admitted, as the workers give
	// them to admission: max_wait, wait_slots, horizon, weights and
	// share_limit (admission.Settings, whose zero fields are defaults).
	admission.Settings
	Line int // where the rule starts in the file
}

// SubjectConfig says where a rule's subject comes from: exactly one field
// is set.
type SubjectConfig struct {
	Fixed        string // one subject for every task
	PayloadField string // a top-level field of the task's JSON payload
}

// Of returns the subject of a task whose payload is payload: Fixed, or
// the value of the field PayloadField (a string, or a number as written).
// An error means the task can never be admitted: a payload that is not a
// JSON object, a missing field, or a value that is null, empty, or not a
// string or number.
func (s SubjectConfig) Of(payload []byte) (string, error) {
	if s.PayloadField != "" {
		return jsonpayload.Field(payload, s.PayloadField)
	}
	return s.Fixed, nil
}

// PriorityConfig says where a task's priority comes from: exactly one
// field is set.
type PriorityConfig struct {
	PayloadField string         // a top-level field of the task's JSON payload: a whole number 0 to 9, 0 if absent
	Queues       map[string]int // the asynq queue's name -> its level; a queue not listed is 0
}

// Of returns the level of a task whose payload is payload, taken from
// queue: the PayloadField's value (0 if the payload has none), or the
// queue's level in Queues (0 if not listed). An error (a payload that is
// not a JSON object, a value that is not a whole number from 0 to 9)
// means the task can never be admitted.
func (c PriorityConfig) Of(payload []byte, queue string) (int, error) {
	if c.PayloadField != "" {
		return jsonpayload.Level(payload, c.PayloadField, admission.MaxPriority)
	}
	return c.Queues[queue], nil
}

// CostConfig says how many permits each task of a rule takes: at most one
// field is set; the zero value is one permit per task.
type CostConfig struct {
	Permits      int    // a fixed number of permits per task, at least 1
	PayloadField string // a top-level field of the task's JSON payload
	// Estimate, for a payload that is an LLM request body (chat
	// completions or messages), is one of the Estimate constants: the
	// tokens estimated from the request (package internal/llmusage: its
	// messages' bytes / 4, its max_tokens), which an http handler with
	// llm: true settles to the answer's usage.
	Estimate string
}

// The estimates of an LLM request's tokens (CostConfig.Estimate).
const (
	EstimateInput  = "input_tokens"  // the messages and system prompt, bytes / 4
	EstimateOutput = "output_tokens" // max_tokens (or max_completion_tokens)
	EstimateTotal  = "total_tokens"  // both
)

// MaxCost bounds a cost, whatever its source.
const MaxCost = jsonpayload.MaxCost

// Of returns the permits a task whose payload is payload takes: Permits,
// the whole number in the field PayloadField (0 to MaxCost), or 1 for the
// zero CostConfig. An error means the task can never be admitted.
func (c CostConfig) Of(payload []byte) (int, error) {
	switch {
	case c.PayloadField != "":
		return jsonpayload.Cost(payload, c.PayloadField)
	case c.Estimate != "":
		return c.estimate(payload)
	case c.Permits > 0:
		return c.Permits, nil
	}
	return 1, nil
}

// estimate is Of for an Estimate.
func (c CostConfig) estimate(payload []byte) (int, error) {
	in, out := 0, 0
	var err error
	if c.Estimate != EstimateOutput {
		if in, err = llmusage.EstimateInput(payload); err != nil {
			return 0, err
		}
	}
	if c.Estimate != EstimateInput {
		if out, err = llmusage.MaxTokens(payload); err != nil {
			return 0, err
		}
	}
	return min(in+out, MaxCost), nil
}

// Used is what an LLM call used under this cost (an Estimate): the
// answer's input, output or total tokens; ok is false for a cost that is
// no Estimate, which the answer does not correct.
func (c CostConfig) Used(u llmusage.Usage) (n int, ok bool) {
	switch c.Estimate {
	case EstimateInput:
		return u.Input, true
	case EstimateOutput:
		return u.Output, true
	case EstimateTotal:
		return u.Total(), true
	}
	return 0, false
}

// LimitCost returns the cost of the rule's i-th limit: its own
// (LimitCosts), or the rule's Cost.
func (r RuleConfig) LimitCost(i int) CostConfig {
	if r.LimitCosts != nil {
		return r.LimitCosts[i]
	}
	return r.Cost
}

// Costs returns what a task whose payload is payload takes under each of
// the rule's Limits, in their order (LimitCosts, each as CostConfig.Of
// reads it), or nil if the rule has one Cost for every limit. An error
// means the task can never be admitted.
func (r RuleConfig) Costs(payload []byte) (throttle.Costs, error) {
	if r.LimitCosts == nil {
		return nil, nil
	}
	c := make(throttle.Costs, len(r.LimitCosts))
	for i, lc := range r.LimitCosts {
		n, err := lc.Of(payload)
		if err != nil {
			return nil, fmt.Errorf("limit %q: %w", r.Limits[i].Name, err)
		}
		c[i] = n
	}
	return c, nil
}

// Load reads and parses the rules file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("rules: reading rules file: %w", err)
	}
	return Parse(path, data)
}

// Parse parses a rules file; name is used in error messages. It
// returns a *Error for the first problem found: YAML syntax, a
// field that is unknown, repeated, missing or of the wrong type, or a value
// out of range.
func Parse(name string, data []byte) (*Config, error) {
	p := &parser{file: name}
	p.Reader = yamlfile.Reader{
		Fail: func(line int, field, reason string) error {
			return &Error{File: name, Line: line, Kind: "rule", Name: p.rule, Field: field, Reason: reason}
		},
		DurationExamples: "1s, 500ms or 1h",
		DurationSyntax:   "(ns, us, ms, s, m, h), such as 1s, 500ms or 1h",
	}
	root, err := p.Root(data, "rules", "the file is empty; it needs a rules list (see rules/README.md)")
	if err != nil {
		return nil, err
	}
	return p.config(root)
}

// Rule returns the rule named name.
func (c *Config) Rule(name string) (RuleConfig, bool) {
	for _, r := range c.Rules {
		if r.Name == name {
			return r, true
		}
	}
	return RuleConfig{}, false
}

// RuleFor returns the rule that applies to tasks of type taskType, as the
// worker middleware chooses it: the rule listing the exact type, else the one
// with the longest matching prefix pattern.
func (c *Config) RuleFor(taskType string) (RuleConfig, bool) {
	var r taskroute.Router[int]
	for i, rc := range c.Rules {
		for _, p := range rc.Tasks {
			r.Add(p, i)
		}
	}
	i, ok := r.Lookup(taskType)
	if !ok {
		return RuleConfig{}, false
	}
	return c.Rules[i], true
}

// Limiter builds the limiter of the rule named rule: its Limits under the
// config's Prefix and FailOpen, with base's Logger, OnRedisError,
// OnHandoff and PrepayAfter (other fields of base are ignored). Producers that pace tasks at enqueue time
// (throttle.Limiter.PrepayN) use it to book in the ledger the workers use.
func (c *Config) Limiter(rdb redis.UniversalClient, rule string, base throttle.Options) (*throttle.Limiter, error) {
	r, ok := c.Rule(rule)
	if !ok {
		return nil, fmt.Errorf("rules: %s: no rule named %q", c.File, rule)
	}
	opts := throttle.Options{Prefix: c.Prefix, FailOpen: c.FailOpen, Logger: base.Logger, OnRedisError: base.OnRedisError, OnHandoff: base.OnHandoff, PrepayAfter: base.PrepayAfter}
	if r.Nested {
		opts.Line = r.Name // its shares' limits are kept in its line (RuleConfig.Nested)
	}
	lim, err := throttle.New(rdb, opts, r.Limits...)
	if err != nil {
		return nil, fmt.Errorf("rules: %s:%d: rule %q: %w", c.File, r.Line, r.Name, err)
	}
	return lim, nil
}
