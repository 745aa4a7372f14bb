package rules

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/taskroute"
	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// maxWaitSlots bounds wait_slots: more waiting handlers per subject than
// this is no longer a bound.
const maxWaitSlots = 10000

// The fields each mapping of a rules file may have.
var (
	limitFields = []string{"name", "algorithm", "limit", "period", "burst", "precision", "lease", "budget"}
	// limitOnly are the rule fields that describe a single limit, which a
	// policy (limits) puts in each of its limits instead.
	limitOnly      = []string{"algorithm", "limit", "period", "burst", "precision", "lease"}
	costFields     = []string{"payload_field", "estimate"}
	priorityFields = []string{"payload_field", "queues", "max_age"}
	// policyLimitFields are a policy limit's: a limit's, and its own cost.
	policyLimitFields = append(slices.Clip(limitFields), "cost")
)

// parser walks a rules file's YAML nodes, keeping the file name and the
// rule being parsed for errors.
type parser struct {
	yamlfile.Reader
	file          string
	rule          string // "" for file-level fields
	budgetsByName map[string]throttle.Rule
}

// maxDuration bounds the durations of a rules file before throttle checks
// them (a limit's period: ten years).
const maxDuration = time.Duration(math.MaxInt64)

// duration reads a duration as Reader.Duration does, in whole
// microseconds: the resolution of throttle's scripts.
func (p *parser) duration(n *yaml.Node, field string, lo, hi time.Duration) (time.Duration, error) {
	d, err := p.Duration(n, field, lo, hi)
	if err == nil && d%time.Microsecond != 0 {
		return 0, p.Failf(n, field, "%q must be a whole number of microseconds", n.Value)
	}
	return d, err
}

// config reads the file whose top node is root.
func (p *parser) config(root *yaml.Node) (*Config, error) {
	c := &Config{File: p.file, Prefix: throttle.DefaultPrefix}
	fields, err := p.Fields(root, "", "the file", []yamlfile.Field{
		{Key: "prefix", Read: yamlfile.Into(&c.Prefix, func(n *yaml.Node, field string) (string, error) {
			return p.Prefix(n, field, throttle.DefaultPrefix)
		})},
		{Key: "fail_open", Read: p.BoolTo(&c.FailOpen)},
		{Key: "budgets", Read: yamlfile.Into(&c.Budgets, p.budgets), Check: func() error {
			p.budgetsByName = map[string]throttle.Rule{}
			for _, b := range c.Budgets {
				p.budgetsByName[b.Name] = b
			}
			return nil
		}},
		{Key: "rules", Missing: "list at least one rule"},
		{Key: handlersField}, // package handler's (HandlersSection)
	})
	if err != nil {
		return nil, err
	}
	c.handlers = fields[handlersField]
	rules := fields["rules"]
	if rules.Kind != yaml.SequenceNode || len(rules.Content) == 0 {
		return nil, p.Failf(rules, "rules", "%s must be a list of at least one rule", yamlfile.Describe(rules))
	}
	names := map[string]int{}
	owner := map[string]string{} // pattern → rule
	for i, rn := range rules.Content {
		r, err := p.ruleConfig(yamlfile.Resolve(rn), i, names, owner)
		if err != nil {
			return nil, err
		}
		c.Rules = append(c.Rules, r)
	}
	if err := p.checkWithin(rules, c.Rules); err != nil {
		return c, err
	}
	return c, p.nest(rules, c.Rules)
}

// nest makes each nested rule of rs (RuleConfig.Nested) a share of the
// rule it is within, or fails with the reason it cannot be.
func (p *parser) nest(rules *yaml.Node, rs []RuleConfig) error {
	byName := map[string]int{}
	for i, r := range rs {
		byName[r.Name] = i
	}
	for i := range rs {
		r := &rs[i]
		if !r.Nested {
			continue
		}
		fail := func(reason string) error {
			p.rule = r.Name
			return p.Failf(yamlfile.Resolve(rules.Content[i]), "nested", "%s", reason)
		}
		if r.Within == "" {
			return fail("needs within: the rule whose subjects this rule's subjects belong to")
		}
		o := rs[byName[r.Within]]
		if reason := notNestable(*r, o); reason != "" {
			return fail(reason + "; without nested: true, within stacks the two rules")
		}
		r.FairBy, r.Subject = r.Subject, o.Subject
		r.ShareLimit = r.Limits[0].Limit
		r.Limits = slices.Clone(o.Limits)
	}
	return nil
}

// notNestable says why r, within o, cannot be nested (RuleConfig.Nested),
// or "" if it can.
func notNestable(r, o RuleConfig) string {
	bucket := func(l throttle.Rule) bool { return l.Algorithm == throttle.GCRA || l.Algorithm == throttle.TokenBucket }
	switch {
	case len(r.Limits) != 1 || !bucket(r.Limits[0]):
		return "a nested rule has one limit, gcra or token_bucket: each of its subjects' share of the outer rule's line"
	case r.FairBy != (SubjectConfig{}) || r.ShareLimit != (throttle.Limit{}) || r.Priority.PayloadField != "" || r.Priority.Queues != nil:
		return "a nested rule's subjects are the shares of the outer rule's line: it has no fair_by, share_limit or priority of its own"
	case o.Within != "":
		return fmt.Sprintf("rule %q is within another rule in turn; a nested rule's outer rule is within none", o.Name)
	case o.FairBy != (SubjectConfig{}) || o.ShareLimit != (throttle.Limit{}) || o.Priority.PayloadField != "" || o.Priority.Queues != nil:
		return fmt.Sprintf("rule %q has fair_by, share_limit or priority, which order its own line", o.Name)
	case r.LimitCosts != nil || o.LimitCosts != nil || r.Cost != o.Cost:
		return fmt.Sprintf("this rule's cost and rule %q's differ or are per limit; a nested rule's tasks take one cost under both", o.Name)
	}
	for _, l := range o.Limits {
		if !bucket(l) {
			return fmt.Sprintf("rule %q has a limit of %s; a line with shares needs gcra or token_bucket limits", o.Name, l.Algorithm)
		}
	}
	return ""
}

// checkWithin checks each rule's within (rs, read from the nodes of
// rules): it names another rule, and following within from any rule never
// comes back to it.
func (p *parser) checkWithin(rules *yaml.Node, rs []RuleConfig) error {
	byName := map[string]int{}
	for i, r := range rs {
		byName[r.Name] = i
	}
	for i, r := range rs {
		seen := map[string]bool{r.Name: true}
		for o := r; o.Within != ""; {
			j, ok := byName[o.Within]
			switch {
			case !ok:
				p.rule = o.Name
				return p.Failf(yamlfile.Resolve(rules.Content[byName[o.Name]]), "within", "%q is not a rule of this file; name the rule whose limits also hold for this rule's tasks", o.Within)
			case seen[o.Within]:
				p.rule = r.Name
				return p.Failf(yamlfile.Resolve(rules.Content[i]), "within", "following within from rule %q comes back to it; a rule cannot be within itself", r.Name)
			}
			seen[o.Within] = true
			o = rs[j]
		}
	}
	return nil
}

// ruleConfig reads the rule at n, the i-th of the file: names and owner
// hold the names and the task patterns of the rules before it.
func (p *parser) ruleConfig(n *yaml.Node, i int, names map[string]int, owner map[string]string) (RuleConfig, error) {
	p.rule = "#" + strconv.Itoa(i+1)
	r := RuleConfig{Line: n.Line}
	fields, err := p.Fields(n, "", "a rule", p.ruleFields(n, &r, names, owner))
	if err != nil {
		return r, err
	}
	if r.Limits, r.LimitCosts, err = p.ruleLimits(n, fields, r.Name); err != nil {
		return r, err
	}
	if r.LimitCosts != nil && fields["cost"] != nil {
		return r, p.Failf(fields["cost"], "cost", "cannot be combined with a cost on a limit; give each limit of the policy its cost (a limit without one takes 1)")
	}
	if r.LimitCosts != nil && fields["share_limit"] != nil {
		return r, p.Failf(fields["share_limit"], "share_limit", "takes one cost per task; it cannot be combined with costs on the limits")
	}
	if err := p.checkSettings(n, fields, r); err != nil {
		return r, err
	}
	return r, p.checkCost(fields["cost"], r)
}

// checkSettings checks r's admission settings (at n, fields) as every
// worker does (admission.Settings.Check), against r's limits: each field's
// own bounds were read, so what is left to refuse is fair_by over a
// concurrency limit, and a share limit that r's limits cannot keep
// (throttle.Limit.CheckShare).
func (p *parser) checkSettings(n *yaml.Node, fields map[string]*yaml.Node, r RuleConfig) error {
	if fn := fields["fair_by"]; fn != nil && slices.ContainsFunc(r.Limits, isConcurrency) {
		// The worker refuses it too, but only once it builds the rule:
		// here --check and a reload name the line.
		return p.Failf(fn, "fair_by", "cannot share a concurrency limit: its queue for places is first come, first served; share a rate limit of the rule instead")
	}
	if fn := fields["priority"]; fn != nil && slices.ContainsFunc(r.Limits, isConcurrency) {
		return p.Failf(fn, "priority", "cannot order a concurrency limit's queue: its places are handed first come, first served; give the priority to a rule of rate limits")
	}
	if fn := fields["priority"]; fn != nil && r.ShareLimit != (throttle.Limit{}) {
		return p.Failf(fn, "priority", "cannot be combined with share_limit: a share its own limit holds back is served in its share's order, not by level; drop one")
	}
	var se *admission.SettingsError
	if err := r.Check(r.Limits...); !errors.As(err, &se) {
		return err // nil
	}
	return p.Failf(cmp.Or(fields[se.Field], n), se.Field, "%s", se.Reason)
}

// ruleFields declares the fields of the rule at n, read into r; those of
// its limits (limitOnly, budget, limits) are read by ruleLimits.
func (p *parser) ruleFields(n *yaml.Node, r *RuleConfig, names map[string]int, owner map[string]string) []yamlfile.Field {
	duration := func(dst *time.Duration, lo, hi time.Duration) yamlfile.ReadFunc {
		return yamlfile.Into(dst, func(v *yaml.Node, field string) (time.Duration, error) { return p.duration(v, field, lo, hi) })
	}
	subject := func(dst *SubjectConfig) yamlfile.ReadFunc {
		return func(v *yaml.Node, field string) (err error) {
			dst.Fixed, dst.PayloadField, err = p.Subject(v, field)
			return err
		}
	}
	fair := func() bool { return r.FairBy != (SubjectConfig{}) }
	decl := []yamlfile.Field{
		{Key: "name", Missing: "give the rule a name (" + yamlfile.NameRule + ")", Read: func(v *yaml.Node, field string) error {
			return p.ruleName(n, v, field, r, names)
		}},
		{Key: "tasks", Missing: `list the task types the rule applies to, such as ["email:send", "stripe:*"]`, Read: yamlfile.Into(&r.Tasks, func(v *yaml.Node, field string) ([]string, error) {
			return p.tasks(v, owner)
		})},
		{Key: "subject", Missing: yamlfile.SubjectHelp, Read: subject(&r.Subject)},
	}
	for _, f := range limitOnly {
		decl = append(decl, yamlfile.Field{Key: f})
	}
	return append(decl, []yamlfile.Field{
		{Key: "max_wait", Read: duration(&r.MaxWait, 0, maxDuration)},
		{Key: "wait_slots", Read: p.IntTo(&r.WaitSlots, 0, maxWaitSlots)},
		{Key: "cost", Read: yamlfile.Into(&r.Cost, p.cost)},
		{Key: "budget"},
		{Key: "limits"},
		{Key: "horizon", Read: duration(&r.Horizon, time.Millisecond, admission.MaxHorizon)},
		{Key: "fair_by", Read: subject(&r.FairBy)},
		{Key: "within", Read: p.StrTo(&r.Within)},
		{Key: "nested", Read: p.BoolTo(&r.Nested)},
		{Key: "priority", Read: yamlfile.Into(&r.Priority, func(v *yaml.Node, _ string) (PriorityConfig, error) { return p.priority(v, &r.MaxAge) })},
		{Key: "weights", Read: yamlfile.Into(&r.Weights, func(v *yaml.Node, _ string) (map[string]int, error) { return p.weights(v, fair()) })},
		{Key: "share_limit", Read: yamlfile.Into(&r.ShareLimit, func(v *yaml.Node, _ string) (throttle.Limit, error) { return p.shareLimit(v, fair()) })},
	}...)
}

// ruleName reads the name (at nn) of the rule at n into r: unique among
// names, and not the name of a budget.
func (p *parser) ruleName(n, nn *yaml.Node, field string, r *RuleConfig, names map[string]int) (err error) {
	if r.Name, err = p.Name(n, nn, field, "the rule", "rule", "", names); err != nil {
		return err
	}
	if _, clash := p.budgetsByName[r.Name]; clash {
		return p.Failf(nn, field, "%q is also the name of a budget; a rule of that name would share the budget's keys, so rename one", r.Name)
	}
	p.rule = r.Name
	return nil
}

// ruleLimits reads the limits of the rule named name at n, whose fields
// are given: a budget, a single limit (limitOnly) or a policy (limits).
// With a policy, it also returns each limit's cost if one of them has a
// cost of its own (nil otherwise).
func (p *parser) ruleLimits(n *yaml.Node, fields map[string]*yaml.Node, name string) ([]throttle.Rule, []CostConfig, error) {
	limits := fields["limits"]
	if bn := fields["budget"]; bn != nil {
		for _, f := range append([]string{"limits"}, limitOnly...) {
			if v := fields[f]; v != nil {
				return nil, nil, p.Failf(v, f, "cannot be combined with budget; the budget defines the limit")
			}
		}
		b, err := p.budget(bn, "budget")
		return []throttle.Rule{b}, nil, err
	}
	if limits == nil {
		l, err := p.limit(n, fields, "", name)
		return []throttle.Rule{l}, nil, err
	}
	for _, f := range limitOnly {
		if v := fields[f]; v != nil {
			return nil, nil, p.Failf(v, f, "cannot be combined with limits; set it in each of the limits")
		}
	}
	return p.policy(limits, name)
}

// policy reads the limits of a policy, the list n, of the rule named
// rule, and their costs (nil if no limit has a cost of its own).
func (p *parser) policy(n *yaml.Node, rule string) ([]throttle.Rule, []CostConfig, error) {
	if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
		return nil, nil, p.Failf(n, "limits", "%s must be a list of at least one limit", yamlfile.Describe(n))
	}
	var out []throttle.Rule
	costs, own := make([]CostConfig, len(n.Content)), false
	seen := map[string]int{}
	for j, ln := range n.Content {
		path := "limits[" + strconv.Itoa(j+1) + "]"
		l, err := p.policyLimit(yamlfile.Resolve(ln), path, rule, seen, out)
		if err != nil {
			return nil, nil, err
		}
		if cn := mappingValue(yamlfile.Resolve(ln), "cost"); cn != nil {
			if costs[j], err = p.limitCost(cn, yamlfile.Join(path, "cost"), l); err != nil {
				return nil, nil, err
			}
			own = true
		}
		out = append(out, l)
	}
	if conc := slices.IndexFunc(out, isConcurrency); conc >= 0 && slices.ContainsFunc(out[conc+1:], isConcurrency) {
		return nil, nil, p.Failf(n, "limits", "a policy has at most one concurrency limit")
	}
	if !own {
		return out, nil, nil
	}
	if conc := slices.IndexFunc(out, isConcurrency); conc >= 0 {
		return nil, nil, p.Failf(n, "limits", "costs on limits cannot be combined with concurrency limit %q; put it in a rule of its own", out[conc].Name)
	}
	return out, costs, nil
}

// limitCost reads the cost (at n, field) of policy limit l: a whole number
// of permits (at most what l admits at once) or {payload_field: <field>}.
func (p *parser) limitCost(n *yaml.Node, field string, l throttle.Rule) (CostConfig, error) {
	c, err := p.cost(n, field)
	if err == nil && c.Permits > l.Capacity() {
		err = p.Failf(n, field, "%d permits per task, but limit %q admits at most %d at once; raise its burst or lower the cost", c.Permits, l.Name, l.Capacity())
	}
	return c, err
}

// policyLimit reads the limit ln of a policy of the rule named rule, at
// path: a budget, or a limit named within the rule (seen: the names
// before it). before are the policy's limits before it.
func (p *parser) policyLimit(ln *yaml.Node, path, rule string, seen map[string]int, before []throttle.Rule) (throttle.Rule, error) {
	if sn := mappingValue(ln, "subject"); sn != nil {
		return throttle.Rule{}, p.Failf(sn, yamlfile.Join(path, "subject"), "a limit cannot have a subject of its own in a rules file: tasks over several subjects could not park without polling. For each tenant's limit inside one API key's, make the key the rule's subject, the tenant its fair_by, and add share_limit; for one budget drawn on by several rules, use budgets (worker/README.md)")
	}
	lf, err := p.Mapping(ln, path, "a limit", policyLimitFields)
	if err != nil {
		return throttle.Rule{}, err
	}
	if bn := lf["budget"]; bn != nil {
		if len(lf) != 1 || lf["cost"] != nil {
			return throttle.Rule{}, p.Failf(ln, path, "a budget entry has only the field budget; the budget defines the limit")
		}
		b, err := p.budget(bn, yamlfile.Join(path, "budget"))
		if err == nil && slices.ContainsFunc(before, func(l throttle.Rule) bool { return l.Name == b.Name }) {
			err = p.Failf(bn, yamlfile.Join(path, "budget"), "%q is listed twice", b.Name)
		}
		return b, err
	}
	name, err := p.Name(ln, lf["name"], yamlfile.Join(path, "name"), "each limit of a policy", "limit", " within a rule", seen)
	if err != nil {
		return throttle.Rule{}, err
	}
	return p.limit(ln, lf, path, rule+"."+name)
}

func isConcurrency(r throttle.Rule) bool { return r.Algorithm == throttle.Concurrency }

// tasks reads a rule's tasks, each a pattern no rule before it has
// (owner: pattern → rule).
func (p *parser) tasks(n *yaml.Node, owner map[string]string) ([]string, error) {
	if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
		return nil, p.Failf(n, "tasks", `%s must be a list of at least one task type or pattern, such as ["email:send", "stripe:*"]`, yamlfile.Describe(n))
	}
	var tasks []string
	for _, tn := range n.Content {
		tn = yamlfile.Resolve(tn)
		t, err := p.Str(tn, "tasks")
		if err != nil {
			return nil, err
		}
		if err := taskroute.CheckPattern(t); err != nil {
			return nil, p.Failf(tn, "tasks", "%v", err)
		}
		if other, dup := owner[t]; dup {
			if other == p.rule {
				return nil, p.Failf(tn, "tasks", "%q is listed twice", t)
			}
			return nil, p.Failf(tn, "tasks", "%q is also in rule %q; a task type takes one rule", t, other)
		}
		owner[t] = p.rule
		tasks = append(tasks, t)
	}
	return tasks, nil
}

// shareLimit reads a rule's share_limit: limit per period, and a burst
// (limit if absent), a leaky bucket for each share of fair_by.
func (p *parser) shareLimit(n *yaml.Node, fair bool) (throttle.Limit, error) {
	var l throttle.Limit
	if !fair {
		return l, p.Failf(n, "share_limit", "limits each share of fair_by; set fair_by too")
	}
	rate := "share_limit is a rate, such as {limit: 10, period: 1s}"
	fields, err := p.Fields(n, "share_limit", "a share limit", []yamlfile.Field{
		{Key: "limit", Missing: rate, Read: p.IntTo(&l.Count, 1, throttle.MaxPermits)},
		{Key: "period", Missing: rate, Read: yamlfile.Into(&l.Period, func(v *yaml.Node, field string) (time.Duration, error) {
			return p.duration(v, field, time.Microsecond, maxDuration)
		})},
		{Key: "burst", Read: p.IntTo(&l.Burst, 1, throttle.MaxPermits)}, // 0 (unset): the limit
	})
	if err != nil {
		return l, err
	}
	// throttle's bounds (burst × period / count, say), as for a gcra limit.
	l, err = l.CheckShare()
	return l, p.throttleError(n, fields, "share_limit", throttle.GCRA, err)
}

// priority reads a rule's priority: {payload_field: <field>} or
// {queues: {<queue>: <level>, ...}}, and max_age (into maxAge) if given.
func (p *parser) priority(n *yaml.Node, maxAge *time.Duration) (PriorityConfig, error) {
	var c PriorityConfig
	help := "give {payload_field: <JSON field>} or {queues: {critical: 2, default: 1}}, levels 0 to 9, and max_age if not 60 horizons"
	fields, err := p.Mapping(n, "priority", "priority", priorityFields)
	if err != nil {
		return c, err
	}
	pf, qs := fields["payload_field"], fields["queues"]
	if (pf == nil) == (qs == nil) {
		return c, p.Failf(n, "priority", "%s; exactly one of payload_field and queues", help)
	}
	if pf != nil {
		if c.PayloadField, err = p.Str(pf, "priority.payload_field"); err == nil && c.PayloadField == "" {
			err = p.Failf(pf, "priority.payload_field", `must name a top-level field of the JSON payload, such as "prio"`)
		}
	} else {
		c.Queues, err = p.priorityQueues(yamlfile.Resolve(qs))
	}
	if err != nil {
		return c, err
	}
	if an := fields["max_age"]; an != nil {
		*maxAge, err = p.duration(an, "priority.max_age", time.Millisecond, 10*365*24*time.Hour)
	}
	return c, err
}

// priorityQueues reads a priority's queues: queue -> level 0 to 9.
func (p *parser) priorityQueues(n *yaml.Node) (map[string]int, error) {
	if n.Kind != yaml.MappingNode || len(n.Content) == 0 {
		return nil, p.Failf(n, "priority.queues", "%s must be a mapping of asynq queue to level (0 to %d), such as {critical: 2, default: 1}", yamlfile.Describe(n), admission.MaxPriority)
	}
	q := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		name := n.Content[i].Value
		v, err := p.Int(yamlfile.Resolve(n.Content[i+1]), "priority.queues."+name, 0, admission.MaxPriority)
		if err != nil {
			return nil, err
		}
		q[name] = v
	}
	return q, nil
}

// weights reads a rule's weights: share -> 1 to 1000.
func (p *parser) weights(n *yaml.Node, fair bool) (map[string]int, error) {
	if !fair {
		return nil, p.Failf(n, "weights", "weigh the shares of fair_by; set fair_by too")
	}
	if n.Kind != yaml.MappingNode {
		return nil, p.Failf(n, "weights", "%s must be a mapping of share to weight, such as {gold: 3}", yamlfile.Describe(n))
	}
	w := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		share := n.Content[i].Value
		v, err := p.Int(yamlfile.Resolve(n.Content[i+1]), "weights."+share, 1, admission.MaxWeight)
		if err != nil {
			return nil, err
		}
		w[share] = v
	}
	return w, nil
}

// budgets reads the file's named limits.
func (p *parser) budgets(n *yaml.Node, _ string) ([]throttle.Rule, error) {
	if n.Kind != yaml.SequenceNode || len(n.Content) == 0 {
		return nil, p.Failf(n, "budgets", "%s must be a list of at least one named limit", yamlfile.Describe(n))
	}
	var out []throttle.Rule
	seen := map[string]int{}
	for j, bn := range n.Content {
		bn = yamlfile.Resolve(bn)
		path := "budgets[" + strconv.Itoa(j+1) + "]"
		bf, err := p.Mapping(bn, path, "a budget", limitFields[:len(limitFields)-1])
		if err != nil {
			return nil, err
		}
		name, err := p.Name(bn, bf["name"], yamlfile.Join(path, "name"), "each budget", "budget", "", seen)
		if err != nil {
			return nil, err
		}
		b, err := p.limit(bn, bf, path, name)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}

// budget reads a reference to a budget of the file.
func (p *parser) budget(n *yaml.Node, field string) (throttle.Rule, error) {
	name, err := p.Str(n, field)
	if err != nil {
		return throttle.Rule{}, err
	}
	b, ok := p.budgetsByName[name]
	if !ok {
		return b, p.Failf(n, field, "%q is not a budget of this file; define it under budgets", name)
	}
	return b, nil
}

// cost reads a rule's cost: a whole number of permits, or
// {payload_field: <field>}.
func (p *parser) cost(n *yaml.Node, field string) (CostConfig, error) {
	var c CostConfig
	if n = yamlfile.Resolve(n); n.Kind != yaml.MappingNode {
		v, err := p.Int(n, field, 1, MaxCost)
		c.Permits = v
		return c, err
	}
	fields, err := p.Mapping(n, field, "cost", costFields)
	if err != nil {
		return c, err
	}
	if e := fields["estimate"]; e != nil {
		return p.estimate(n, e, field, len(fields))
	}
	v := fields["payload_field"]
	if v == nil {
		return c, p.Failf(n, field, "give a whole number of permits, {payload_field: <JSON field>} or {estimate: input_tokens, output_tokens or total_tokens}")
	}
	pf := yamlfile.Join(field, "payload_field")
	if c.PayloadField, err = p.Str(v, pf); err != nil {
		return c, err
	}
	if c.PayloadField == "" {
		return c, p.Failf(v, pf, `must name a top-level field of the JSON payload, such as "recipients"`)
	}
	return c, nil
}

// estimate reads a cost's estimate (at e, in the mapping n of nfields
// fields at field): the tokens of an LLM request body.
func (p *parser) estimate(n, e *yaml.Node, field string, nfields int) (CostConfig, error) {
	var c CostConfig
	if nfields != 1 {
		return c, p.Failf(n, field, "give either payload_field or estimate")
	}
	ef := yamlfile.Join(field, "estimate")
	var err error
	if c.Estimate, err = p.Str(e, ef); err != nil {
		return c, err
	}
	switch c.Estimate {
	case EstimateInput, EstimateOutput, EstimateTotal:
		return c, nil
	}
	return c, p.Failf(e, ef, "%q: use input_tokens (the request's messages, bytes / 4), output_tokens (its max_tokens) or total_tokens (both)", c.Estimate)
}

// DefaultLease is the lease of a concurrency rule whose lease is not set:
// how long a place is kept for a worker that stopped renewing it (killed),
// and so how long such a place stays taken.
const DefaultLease = 30 * time.Second

// concurrency reads a concurrency limit: limit places, each leased for
// lease (DefaultLease if unset); period, burst and precision do not apply.
func (p *parser) concurrency(n *yaml.Node, fields map[string]*yaml.Node, path string, r throttle.Rule) (throttle.Rule, error) {
	f := func(field string) string { return yamlfile.Join(path, field) }
	for _, field := range []string{"period", "burst", "precision"} {
		if v := fields[field]; v != nil {
			return r, p.Failf(v, f(field), "does not apply to concurrency, which limits tasks running at once; give limit and lease")
		}
	}
	ln := fields["limit"]
	if ln == nil {
		return r, p.Failf(n, f("limit"), "missing; how many tasks may run at once, such as 5")
	}
	var err error
	if r.Limit.Count, err = p.AtLeast(ln, f("limit"), 1, throttle.MaxPermits); err != nil {
		return r, err
	}
	r.Limit.Period, r.Limit.Burst = DefaultLease, r.Limit.Count
	if le := fields["lease"]; le != nil {
		if r.Limit.Period, err = p.duration(le, f("lease"), 100*time.Millisecond, maxDuration); err != nil {
			return r, err
		}
	}
	return p.validate(n, fields, path, r)
}

// ratePeriod reads the period of a rate limit, a duration; a calendar
// (day@UTC) there is a calendar quota written with another algorithm.
func (p *parser) ratePeriod(pn *yaml.Node, field string) (time.Duration, error) {
	if strings.Contains(pn.Value, "@") {
		return 0, p.Failf(pn, field, "%q is a calendar; a quota on the calendar needs algorithm %s", pn.Value, throttle.CalendarWindow)
	}
	return p.duration(pn, field, time.Microsecond, maxDuration)
}

// calendar reads a calendar quota: limit per period, a calendar such as
// day@America/Los_Angeles (throttle.ParseCalendar).
func (p *parser) calendar(n *yaml.Node, fields map[string]*yaml.Node, path string, r throttle.Rule) (throttle.Rule, error) {
	f := func(field string) string { return yamlfile.Join(path, field) }
	for _, field := range []string{"burst", "precision", "lease"} {
		if v := fields[field]; v != nil {
			return r, p.Failf(v, f(field), "does not apply to calendar, which admits limit per calendar period")
		}
	}
	ln, pn := fields["limit"], fields["period"]
	if ln == nil {
		return r, p.Failf(n, f("limit"), "missing; how many tasks per calendar period, such as 1000")
	}
	if pn == nil {
		return r, p.Failf(n, f("period"), "missing; a calendar such as day@UTC, week@Europe/Berlin or month@America/Los_Angeles")
	}
	var err error
	if r.Limit.Count, err = p.AtLeast(ln, f("limit"), 1, throttle.MaxPermits); err != nil {
		return r, err
	}
	s, err := p.Str(pn, f("period"))
	if err != nil {
		return r, err
	}
	if r.Calendar, err = throttle.ParseCalendar(s); err != nil {
		return r, p.Failf(pn, f("period"), "%s", strings.TrimPrefix(err.Error(), "throttle: "))
	}
	// As a limiter reports the rule: the unit's nominal period (for the
	// estimates other rules' periods give), a burst of its count.
	r.Limit.Period, r.Limit.Burst = r.Calendar.Period(), r.Limit.Count
	return p.validate(n, fields, path, r)
}

// checkCost refuses a fixed cost (at n) that a limit of r or its share
// limit can never admit at once (its capacity).
func (p *parser) checkCost(n *yaml.Node, r RuleConfig) error {
	if sl := r.ShareLimit; sl.Count > 0 && r.Cost.Permits > sl.Burst {
		return p.Failf(n, "cost", "%d permits per task, but share_limit admits at most %d at once; raise its burst or lower the cost", r.Cost.Permits, sl.Burst)
	}
	for _, l := range r.Limits {
		if capacity := l.Capacity(); r.Cost.Permits > capacity {
			return p.Failf(n, "cost", "%d permits per task, but limit %q admits at most %d at once; raise its burst or lower the cost", r.Cost.Permits, l.Name, capacity)
		}
	}
	return nil
}

// limit reads one limit's algorithm, limit, period, burst and precision
// from fields (of the mapping at n; path prefixes field names in errors)
// as a throttle.Rule named name.
func (p *parser) limit(n *yaml.Node, fields map[string]*yaml.Node, path, name string) (throttle.Rule, error) {
	r := throttle.Rule{Name: name}
	f := func(field string) string { return yamlfile.Join(path, field) }
	need := func(field, help string) (*yaml.Node, error) {
		if v := fields[field]; v != nil {
			return v, nil
		}
		return nil, p.Failf(n, f(field), "missing; %s", help)
	}

	an, err := need("algorithm", "one of "+listAlgorithms(throttle.Algorithms(), "", ", "))
	if err != nil {
		return r, err
	}
	as, err := p.Str(an, f("algorithm"))
	if err != nil {
		return r, err
	}
	if r.Algorithm, err = ParseAlgorithm(as); err != nil {
		return r, p.Failf(an, f("algorithm"), "%q is not one of %s", as, listAlgorithms(throttle.Algorithms(), " (or %s)", ", "))
	}
	switch r.Algorithm {
	case throttle.Concurrency:
		return p.concurrency(n, fields, path, r)
	case throttle.CalendarWindow:
		return p.calendar(n, fields, path, r)
	}
	if ln := fields["lease"]; ln != nil {
		return r, p.Failf(ln, f("lease"), "applies only to concurrency")
	}

	// Upper bounds are throttle's: throttle.MaxPermits here, and r.Validate below
	// reports the rest (bucket horizons).
	ln, err := need("limit", "how many tasks per period, such as 20")
	if err != nil {
		return r, err
	}
	if r.Limit.Count, err = p.AtLeast(ln, f("limit"), 1, throttle.MaxPermits); err != nil {
		return r, err
	}
	pn, err := need("period", "a duration such as 1s, 1m or 1h")
	if err != nil {
		return r, err
	}
	if r.Limit.Period, err = p.ratePeriod(pn, f("period")); err != nil {
		return r, err
	}

	r.Limit.Burst = r.Limit.Count
	if bn := fields["burst"]; bn != nil {
		if !r.Algorithm.Bucket() {
			return r, p.Failf(bn, f("burst"), "applies only to token_bucket and gcra; %v admits limit per period", r.Algorithm)
		}
		if r.Limit.Burst, err = p.AtLeast(bn, f("burst"), 1, throttle.MaxPermits); err != nil {
			return r, err
		}
	}
	if pr := fields["precision"]; pr != nil {
		if r.Algorithm != throttle.SlidingWindow {
			return r, p.Failf(pr, f("precision"), "applies only to sliding_window")
		}
		if r.Precision, err = p.duration(pr, f("precision"), time.Microsecond, maxDuration); err != nil {
			return r, err
		}
		if r.Precision > r.Limit.Period {
			return r, p.Failf(pr, f("precision"), "%q must not exceed the period %v", pr.Value, r.Limit.Period)
		}
	}
	return p.validate(n, fields, path, r)
}

// validate reports what the checks of limit and concurrency leave to
// throttle (upper bounds, bucket horizons, bucket counts), as
// throttleError does.
func (p *parser) validate(n *yaml.Node, fields map[string]*yaml.Node, path string, r throttle.Rule) (throttle.Rule, error) {
	return r, p.throttleError(n, fields, path, r.Algorithm, r.Validate())
}

// throttleError reports err, throttle's verdict on a limit of algorithm a
// read from fields (of the mapping at n; path prefixes field names), at
// the field throttle names: count is the file's limit, and a concurrency
// rule's period its lease. A *throttle.ConfigError's Reason is given at
// that field; other errors at path. nil is nil.
func (p *parser) throttleError(n *yaml.Node, fields map[string]*yaml.Node, path string, a throttle.Algorithm, err error) error {
	if err == nil {
		return nil
	}
	var ce *throttle.ConfigError
	if !errors.As(err, &ce) {
		return p.Failf(n, path, "%v", err)
	}
	field, line := ce.Field, n
	switch {
	case field == "count":
		field = "limit"
	case field == "period" && a == throttle.Concurrency:
		field = "lease"
	}
	if v := fields[field]; v != nil {
		line = v
	}
	return p.Failf(line, yamlfile.Join(path, field), "%s", ce.Reason)
}

// mappingValue returns the value of key in the mapping n, or nil (also if n
// is not a mapping).
func mappingValue(n *yaml.Node, key string) *yaml.Node {
	if n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}
