package rules

import (
	"errors"
	"go.yaml.in/yaml/v3"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/taskroute"
	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// maxWaitSlots bounds wait_slots: more waiting handlers per subject than
// this is no longer a bound.
const maxWaitSlots = 10000

// The fields each mapping of a rules file may have.
var (
	fileFields  = []string{"prefix", "fail_open", "budgets", "rules", handlersField}
	ruleFields  = []string{"name", "tasks", "subject", "algorithm", "limit", "period", "burst", "precision", "lease", "max_wait", "wait_slots", "cost", "budget", "limits", "horizon", "fair_by", "weights", "share_limit"}
	limitFields = []string{"name", "algorithm", "limit", "period", "burst", "precision", "lease", "budget"}
	// limitOnly are the rule fields that describe a single limit, which a
	// policy (limits) puts in each of its limits instead.
	limitOnly  = []string{"algorithm", "limit", "period", "burst", "precision", "lease"}
	costFields = []string{"payload_field"}
)

// parser walks a rules file's YAML nodes, keeping the file name and the
// rule being parsed for errors.
type parser struct {
	yamlfile.Reader
	file          string
	rule          string // "" for file-level fields
	budgetsByName map[string]throttle.Rule
}

// duration reads a duration as Reader.Duration does, in whole
// microseconds: the resolution of throttle's scripts.
// maxDuration bounds the durations of a rules file before throttle checks
// them (a limit's period: ten years).
const maxDuration = time.Duration(math.MaxInt64)

func (p *parser) duration(n *yaml.Node, field string, lo, hi time.Duration) (time.Duration, error) {
	d, err := p.Duration(n, field, lo, hi)
	if err == nil && d%time.Microsecond != 0 {
		return 0, p.Failf(n, field, "%q must be a whole number of microseconds", n.Value)
	}
	return d, err
}

func (p *parser) config(root *yaml.Node) (*Config, error) {
	fields, err := p.Mapping(root, "", "the file", fileFields)
	if err != nil {
		return nil, err
	}
	c := &Config{File: p.file, Prefix: throttle.DefaultPrefix}
	if n := fields["prefix"]; n != nil {
		if c.Prefix, err = p.Prefix(n, "prefix", throttle.DefaultPrefix); err != nil {
			return nil, err
		}
	}
	if n := fields["fail_open"]; n != nil {
		if c.FailOpen, err = p.Bool(n, "fail_open"); err != nil {
			return nil, err
		}
	}
	if n := fields["budgets"]; n != nil {
		if c.Budgets, err = p.budgets(n); err != nil {
			return nil, err
		}
	}
	p.budgetsByName = map[string]throttle.Rule{}
	for _, b := range c.Budgets {
		p.budgetsByName[b.Name] = b
	}
	rules := fields["rules"]
	if rules == nil {
		return nil, p.Failf(root, "rules", "missing; list at least one rule")
	}
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
	return c, nil
}

func (p *parser) ruleConfig(n *yaml.Node, i int, names map[string]int, owner map[string]string) (RuleConfig, error) {
	p.rule = "#" + strconv.Itoa(i+1)
	fields, err := p.Mapping(n, "", "a rule", ruleFields)
	if err != nil {
		return RuleConfig{}, err
	}
	r := RuleConfig{Line: n.Line}

	nn := fields["name"]
	if r.Name, err = p.Name(n, nn, "name", "the rule", "rule", "", names); err != nil {
		return r, err
	}
	if _, clash := p.budgetsByName[r.Name]; clash {
		return r, p.Failf(nn, "name", "%q is also the name of a budget; a rule of that name would share the budget's keys, so rename one", r.Name)
	}
	p.rule = r.Name

	if r.Tasks, err = p.tasks(n, fields["tasks"], owner); err != nil {
		return r, err
	}
	if r.Subject, err = p.subject(n, fields["subject"]); err != nil {
		return r, err
	}
	if mw := fields["max_wait"]; mw != nil {
		if r.MaxWait, err = p.duration(mw, "max_wait", 0, maxDuration); err != nil {
			return r, err
		}
	}
	if ws := fields["wait_slots"]; ws != nil {
		if r.WaitSlots, err = p.Int(ws, "wait_slots", 0, maxWaitSlots); err != nil {
			return r, err
		}
	}
	costNode := fields["cost"]
	if r.Cost, err = p.cost(costNode); err != nil {
		return r, err
	}
	if hn := fields["horizon"]; hn != nil {
		if r.Horizon, err = p.duration(hn, "horizon", time.Millisecond, 24*time.Hour); err != nil {
			return r, err
		}
	}
	if fb := fields["fair_by"]; fb != nil {
		if r.FairBy.Fixed, r.FairBy.PayloadField, err = p.Subject(fb, "fair_by"); err != nil {
			return r, err
		}
	}
	if wn := fields["weights"]; wn != nil {
		if r.Weights, err = p.weights(wn, fields["fair_by"] != nil); err != nil {
			return r, err
		}
	}
	if sn := fields["share_limit"]; sn != nil {
		if r.ShareLimit, err = p.shareLimit(sn, fields["fair_by"] != nil); err != nil {
			return r, err
		}
	}

	limits := fields["limits"]
	if bn := fields["budget"]; bn != nil {
		for _, f := range append([]string{"limits"}, limitOnly...) {
			if v := fields[f]; v != nil {
				return r, p.Failf(v, f, "cannot be combined with budget; the budget defines the limit")
			}
		}
		b, err := p.budget(bn, "budget")
		if err != nil {
			return r, err
		}
		r.Limits = []throttle.Rule{b}
		return r, p.checkCost(costNode, fields["share_limit"], r)
	}
	if limits == nil {
		l, err := p.limit(n, fields, "", r.Name)
		if err != nil {
			return r, err
		}
		r.Limits = []throttle.Rule{l}
		return r, p.checkCost(costNode, fields["share_limit"], r)
	}
	for _, f := range limitOnly {
		if v := fields[f]; v != nil {
			return r, p.Failf(v, f, "cannot be combined with limits; set it in each of the limits")
		}
	}
	if limits.Kind != yaml.SequenceNode || len(limits.Content) == 0 {
		return r, p.Failf(limits, "limits", "%s must be a list of at least one limit", yamlfile.Describe(limits))
	}
	seen := map[string]int{}
	for j, ln := range limits.Content {
		ln = yamlfile.Resolve(ln)
		path := "limits[" + strconv.Itoa(j+1) + "]"
		if sn := mappingValue(ln, "subject"); sn != nil {
			return r, p.Failf(sn, yamlfile.Join(path, "subject"), "a limit cannot have a subject of its own in a rules file: tasks over several subjects could not park without polling. For each tenant's limit inside one API key's, make the key the rule's subject, the tenant its fair_by, and add share_limit; for one budget drawn on by several rules, use budgets (worker/README.md)")
		}
		lf, err := p.Mapping(ln, path, "a limit", limitFields)
		if err != nil {
			return r, err
		}
		if bn := lf["budget"]; bn != nil {
			if len(lf) != 1 {
				return r, p.Failf(ln, path, "a budget entry has only the field budget; the budget defines the limit")
			}
			b, err := p.budget(bn, yamlfile.Join(path, "budget"))
			if err != nil {
				return r, err
			}
			for _, l := range r.Limits {
				if l.Name == b.Name {
					return r, p.Failf(bn, yamlfile.Join(path, "budget"), "%q is listed twice", b.Name)
				}
			}
			r.Limits = append(r.Limits, b)
			continue
		}
		name, err := p.Name(ln, lf["name"], yamlfile.Join(path, "name"), "each limit of a policy", "limit", " within a rule", seen)
		if err != nil {
			return r, err
		}
		l, err := p.limit(ln, lf, path, r.Name+"."+name)
		if err != nil {
			return r, err
		}
		r.Limits = append(r.Limits, l)
	}
	if conc := slices.IndexFunc(r.Limits, isConcurrency); conc >= 0 && slices.ContainsFunc(r.Limits[conc+1:], isConcurrency) {
		return r, p.Failf(limits, "limits", "a policy has at most one concurrency limit")
	}
	return r, p.checkCost(costNode, fields["share_limit"], r)
}

func isConcurrency(r throttle.Rule) bool { return r.Algorithm == throttle.Concurrency }

func (p *parser) tasks(rule, n *yaml.Node, owner map[string]string) ([]string, error) {
	if n == nil {
		return nil, p.Failf(rule, "tasks", `missing; list the task types the rule applies to, such as ["email:send", "stripe:*"]`)
	}
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
	fields, err := p.Mapping(n, "share_limit", "a share limit", []string{"limit", "period", "burst"})
	if err != nil {
		return l, err
	}
	for _, f := range []string{"limit", "period"} {
		if fields[f] == nil {
			return l, p.Failf(n, "share_limit."+f, "missing; share_limit is a rate, such as {limit: 10, period: 1s}")
		}
	}
	if l.Count, err = p.Int(fields["limit"], "share_limit.limit", 1, throttle.MaxPermits); err != nil {
		return l, err
	}
	if l.Period, err = p.duration(fields["period"], "share_limit.period", time.Microsecond, maxDuration); err != nil {
		return l, err
	}
	l.Burst = l.Count
	if bn := fields["burst"]; bn != nil {
		if l.Burst, err = p.Int(bn, "share_limit.burst", 1, throttle.MaxPermits); err != nil {
			return l, err
		}
	}
	// throttle's bounds (burst × period / count, say), as for a gcra limit.
	r, err := p.validate(n, fields, "share_limit", throttle.Rule{Name: "share_limit", Algorithm: throttle.GCRA, Limit: l})
	return r.Limit, err
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
		v, err := p.Int(yamlfile.Resolve(n.Content[i+1]), "weights."+share, 1, 1000)
		if err != nil {
			return nil, err
		}
		w[share] = v
	}
	return w, nil
}

func (p *parser) subject(rule, n *yaml.Node) (SubjectConfig, error) {
	if n == nil {
		return SubjectConfig{}, p.Failf(rule, "subject", "missing; %s", yamlfile.SubjectHelp)
	}
	var s SubjectConfig
	var err error
	s.Fixed, s.PayloadField, err = p.Subject(n, "subject")
	return s, err
}

// budgets reads the file's named limits.
func (p *parser) budgets(n *yaml.Node) ([]throttle.Rule, error) {
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
// {payload_field: <field>}; nil is the default, one permit.
func (p *parser) cost(n *yaml.Node) (CostConfig, error) {
	var c CostConfig
	if n == nil {
		return c, nil
	}
	if n = yamlfile.Resolve(n); n.Kind != yaml.MappingNode {
		v, err := p.Int(n, "cost", 1, MaxCost)
		c.Permits = v
		return c, err
	}
	fields, err := p.Mapping(n, "cost", "cost", costFields)
	if err != nil {
		return c, err
	}
	v := fields["payload_field"]
	if v == nil {
		return c, p.Failf(n, "cost", "give a whole number of permits, or {payload_field: <JSON field>}")
	}
	if c.PayloadField, err = p.Str(v, "cost.payload_field"); err != nil {
		return c, err
	}
	if c.PayloadField == "" {
		return c, p.Failf(v, "cost.payload_field", `must name a top-level field of the JSON payload, such as "recipients"`)
	}
	return c, nil
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

// checkCost refuses a fixed cost that a limit of r (or its share limit,
// set at sn) can never admit at once (its burst, or a window's limit), and
// a share limit beside a concurrency limit.
func (p *parser) checkCost(n, sn *yaml.Node, r RuleConfig) error {
	if sl := r.ShareLimit; sl.Count > 0 && r.Cost.Permits > sl.Burst {
		return p.Failf(n, "cost", "%d permits per task, but share_limit admits at most %d at once; raise its burst or lower the cost", r.Cost.Permits, sl.Burst)
	}
	for _, l := range r.Limits {
		if l.Algorithm == throttle.Concurrency {
			if sn != nil {
				return p.Failf(sn, "share_limit", "cannot limit the shares of concurrency limit %q: it has no line to keep them in", l.Name)
			}
			continue // a task takes one place, whatever its cost
		}
		if sn != nil && l.Algorithm != throttle.GCRA && l.Algorithm != throttle.TokenBucket {
			return p.Failf(sn, "share_limit", "needs limits of gcra or token_bucket, which can book a turn for any moment; limit %q is %s", l.Name, l.Algorithm)
		}
		capacity := l.Limit.Count
		if l.Algorithm == throttle.TokenBucket || l.Algorithm == throttle.GCRA {
			capacity = l.Limit.Burst
		}
		if r.Cost.Permits > capacity {
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

	an, err := need("algorithm", "one of fixed_window, sliding_log, sliding_window, token_bucket, gcra, concurrency")
	if err != nil {
		return r, err
	}
	as, err := p.Str(an, f("algorithm"))
	if err != nil {
		return r, err
	}
	if r.Algorithm, err = ParseAlgorithm(as); err != nil {
		return r, p.Failf(an, f("algorithm"), "%q is not one of fixed_window, sliding_log, sliding_window, token_bucket, gcra (or leaky_bucket), concurrency", as)
	}
	if r.Algorithm == throttle.Concurrency {
		return p.concurrency(n, fields, path, r)
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
	if r.Limit.Period, err = p.duration(pn, f("period"), time.Microsecond, maxDuration); err != nil {
		return r, err
	}

	bucket := r.Algorithm == throttle.TokenBucket || r.Algorithm == throttle.GCRA
	r.Limit.Burst = r.Limit.Count
	if bn := fields["burst"]; bn != nil {
		if !bucket {
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
// throttle (upper bounds, bucket horizons, bucket counts) at the field
// throttle names: count is the file's limit, and a concurrency rule's
// period its lease.
func (p *parser) validate(n *yaml.Node, fields map[string]*yaml.Node, path string, r throttle.Rule) (throttle.Rule, error) {
	f := func(field string) string { return yamlfile.Join(path, field) }
	if err := r.Validate(); err != nil {
		var ce *throttle.ConfigError
		field, line := "", n
		if errors.As(err, &ce) {
			field = ce.Field
			switch {
			case field == "count":
				field = "limit"
			case field == "period" && r.Algorithm == throttle.Concurrency:
				field = "lease"
			}
			if v := fields[field]; v != nil {
				line = v
			}
			return r, p.Failf(line, f(field), "%s", ce.Reason)
		}
		return r, p.Failf(line, path, "%v", err)
	}
	return r, nil
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
