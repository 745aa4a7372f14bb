package enqueue

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/robfig/cron/v3"
	"go.yaml.in/yaml/v3"

	"github.com/jobthrottle/jobthrottle/internal/yamlfile"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Schedules is a parsed schedules file (see cmd/enqueue/README.md):
//
//	rules: rules.yaml          # the workers' rules file, for paced schedules
//	schedules:
//	  - name: nightly-sync
//	    cron: "0 2 * * *"
//	    type: sync:account
//	    payloads: accounts.jsonl
//	    pace: {}               # the rule the workers apply to sync:account
//	    overlap: skip
type Schedules struct {
	// File is the name the file was parsed under, used in messages.
	File string
	// Rules is the workers' rules file as written (relative to File's
	// directory); "" if none. LoadSchedules loads it into RulesConfig.
	Rules       string
	RulesConfig *rules.Config
	// Prefix is the key prefix of inline pace rules; if the file has none,
	// throttle.DefaultPrefix.
	Prefix    string
	Schedules []Schedule
}

// Overlap says what a firing does while the schedule's previous batch is
// still running (being enqueued, or its last task not yet due).
type Overlap int

const (
	// OverlapSkip drops the firing (cron.SkipIfStillRunning). The default.
	OverlapSkip Overlap = iota
	// OverlapDelay runs the firing once the previous one is over
	// (cron.DelayIfStillRunning).
	OverlapDelay
)

// String returns "skip" or "delay", as schedules files spell them.
func (o Overlap) String() string {
	if o == OverlapDelay {
		return "delay"
	}
	return "skip"
}

// Schedule is one entry of a schedules file.
type Schedule struct {
	Name     string
	Cron     string // the spec as written
	Timezone string // IANA zone; "" for the local zone
	Type     string
	Count    int    // 0: one task per line of Payloads
	Payload  []byte // JSON, or nil
	Payloads string // JSON-lines file as written, or ""
	Queue    string // "" for asynq's default queue
	MaxRetry int    // -1 for asynq's default
	Timeout  time.Duration
	// Retention keeps completed tasks (and their results) this long
	// (asynq.Retention); 0 for asynq's default (none).
	Retention time.Duration
	Overlap   Overlap
	// Pace is nil for an unpaced schedule. Its Rules is set by
	// LoadSchedules from the file's rules.
	Pace *PaceSpec
	Line int

	schedule cron.Schedule
	loaded   *PayloadFile // Payloads, read by LoadSchedules
}

// batch returns the schedule's batch, unpaced: its tasks, payloads and
// asynq options.
func (sc *Schedule) batch() Batch {
	b := Batch{Type: sc.Type, Count: sc.Count}
	switch {
	case sc.Payload != nil:
		b.Payloads = [][]byte{sc.Payload}
	case sc.loaded != nil:
		b.Payloads, b.Where = sc.loaded.Payloads, sc.loaded.Where
	}
	if sc.Queue != "" {
		b.Options = append(b.Options, asynq.Queue(sc.Queue))
	}
	if sc.MaxRetry >= 0 {
		b.Options = append(b.Options, asynq.MaxRetry(sc.MaxRetry))
	}
	if sc.Timeout > 0 {
		b.Options = append(b.Options, asynq.Timeout(sc.Timeout))
	}
	if sc.Retention > 0 {
		b.Options = append(b.Options, asynq.Retention(sc.Retention))
	}
	return b
}

// Next returns the schedule's first firing after t.
func (s *Schedule) Next(t time.Time) time.Time { return s.schedule.Next(t) }

// MaxRetention bounds a schedule's retention: 90 days.
const MaxRetention = 90 * 24 * time.Hour

// The fields each mapping may have.
var (
	// inlineOnly are the pace fields of an inline rule only.
	inlineOnly = []string{"burst", "algorithm", "subject"}
)

// cronParser reads standard five-field specs, six fields with seconds
// first, and descriptors such as @hourly and @every 10s.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// LoadSchedules reads and parses the schedules file at path, then loads
// the workers' rules file and the payload files it names (relative to its
// directory) and checks that every paced schedule has a rule to pace under.
func LoadSchedules(path string) (*Schedules, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("enqueue: reading schedules file: %w", err)
	}
	s, err := ParseSchedules(path, data)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	rel := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	if s.Rules != "" {
		if s.RulesConfig, err = rules.Load(rel(s.Rules)); err != nil {
			return nil, fmt.Errorf("enqueue: %s: rules: %w", path, err)
		}
	}
	for i := range s.Schedules {
		sc := &s.Schedules[i]
		fail := func(field, format string, args ...any) error {
			return &rules.Error{File: path, Line: sc.Line, Kind: "schedule", Name: sc.Name, Field: field, Reason: fmt.Sprintf(format, args...)}
		}
		if sc.Payloads != "" {
			if sc.loaded, err = ReadPayloads(rel(sc.Payloads)); err != nil {
				return nil, fail("payloads", "%v", err)
			}
			if len(sc.loaded.Payloads) == 0 {
				return nil, fail("payloads", "%s has no payload lines", sc.Payloads)
			}
			if sc.Count > len(sc.loaded.Payloads) {
				return nil, fail("count", "%d is more than the %d payloads in %s", sc.Count, len(sc.loaded.Payloads), sc.Payloads)
			}
		}
		if sc.Pace == nil {
			continue
		}
		if sc.Pace.Limit.Count == 0 {
			sc.Pace.Rules = s.RulesConfig
		}
		subject, cost, err := sc.Pace.terms(sc.Type)
		if err != nil {
			return nil, fail("pace", "%v", strings.TrimPrefix(err.Error(), "enqueue: "))
		}
		// Every firing would fail on a payload without the subject or
		// the cost: say so now. (NewScheduler checks them against the
		// rule's capacity too, with its limiter.)
		probe := sc.batch()
		probe.Pacer = &Pacer{Subject: subject, Cost: cost, Costs: sc.Pace.costs(sc.Type)}
		if _, err := probe.scan(); err != nil {
			var pe *PayloadError
			errors.As(err, &pe)
			if sc.Payloads != "" {
				return nil, fail("payloads", "%s: %v; a paced task needs the subject (and cost) the workers' rule reads", pe.Where, pe.Err)
			}
			return nil, fail("payload", "%v; a paced task needs the subject (and cost) the workers' rule reads", pe.Err)
		}
	}
	return s, nil
}

// ParseSchedules parses a schedules file; name is used in error messages.
// It reads no other file (LoadSchedules does). It returns a
// *rules.Error for the first problem found: YAML syntax, a field that
// is unknown, repeated, missing or of the wrong type, a value out of
// range, or fields that do not go together.
func ParseSchedules(name string, data []byte) (*Schedules, error) {
	p := &parser{file: name}
	p.Reader = yamlfile.Reader{
		Fail: func(line int, field, reason string) error {
			return &rules.Error{File: name, Line: line, Kind: "schedule", Name: p.schedule, Field: field, Reason: reason}
		},
		DurationExamples: "30s, 5m or 1h",
		DurationSyntax:   "(ms, s, m, h), such as 30s or 1h",
	}
	root, err := p.Root(data, "schedules", emptyFile)
	if err != nil {
		return nil, err
	}
	return p.parse(root)
}

// emptyFile is the reason given for a schedules file with nothing in it.
const emptyFile = "the file is empty; it needs a schedules list (see cmd/enqueue/README.md)"

// parser walks a schedules file's YAML nodes, keeping the file name and
// the schedule being parsed for errors.
type parser struct {
	yamlfile.Reader
	file     string
	schedule string // "" for file-level fields
}

func (p *parser) parse(root *yaml.Node) (*Schedules, error) {
	if root.Kind == yaml.ScalarNode && root.ShortTag() == "!!null" && root.Value == "" {
		// "---" alone: a document with nothing in it.
		return nil, p.Failf(nil, "", emptyFile)
	}
	s := &Schedules{File: p.file, Prefix: throttle.DefaultPrefix}
	fields, err := p.Fields(root, "", "the file", []yamlfile.Field{
		{Key: "rules", Read: yamlfile.Into(&s.Rules, func(n *yaml.Node, field string) (string, error) {
			return p.nonEmpty(n, field, "the path of the workers' rules file")
		})},
		{Key: "prefix", Read: yamlfile.Into(&s.Prefix, func(n *yaml.Node, field string) (string, error) {
			return p.Prefix(n, field, throttle.DefaultPrefix)
		})},
		{Key: "schedules", Missing: "list at least one schedule"},
	})
	if err != nil {
		return nil, err
	}
	list := fields["schedules"]
	if list.Kind != yaml.SequenceNode || len(list.Content) == 0 {
		return nil, p.Failf(list, "schedules", "%s must be a list of at least one schedule", yamlfile.Describe(list))
	}
	names := map[string]int{}
	for i, n := range list.Content {
		sc, err := p.scheduleAt(yamlfile.Resolve(n), i, names, s)
		if err != nil {
			return nil, err
		}
		s.Schedules = append(s.Schedules, sc)
	}
	return s, nil
}

func (p *parser) scheduleAt(n *yaml.Node, i int, names map[string]int, file *Schedules) (Schedule, error) {
	p.schedule = "#" + strconv.Itoa(i+1)
	if name := peekName(n); yamlfile.ValidName(name) {
		p.schedule = name // errors before the name is read still name it
	}
	sc := Schedule{Line: n.Line, MaxRetry: -1}
	_, err := p.Fields(n, "", "a schedule", p.scheduleFields(n, &sc, names, file))
	return sc, err
}

// scheduleFields declares the fields of the schedule at n, read into sc:
// names holds the names of the schedules before it, file the file's own
// fields (for pace).
func (p *parser) scheduleFields(n *yaml.Node, sc *Schedule, names map[string]int, file *Schedules) []yamlfile.Field {
	nonEmpty := func(dst *string, what string) yamlfile.ReadFunc {
		return yamlfile.Into(dst, func(v *yaml.Node, field string) (string, error) { return p.nonEmpty(v, field, what) })
	}
	var cronNode, payloadNode *yaml.Node // for the checks that tie them to later fields
	return []yamlfile.Field{
		{Key: "name", Missing: "give the schedule a name (" + yamlfile.NameRule + ")", Read: func(v *yaml.Node, field string) (err error) {
			sc.Name, err = p.Name(n, v, field, "the schedule", "schedule", "", names)
			p.schedule = sc.Name
			return err
		}},
		{Key: "cron", Missing: `give a cron spec such as "*/5 * * * *" (minute hour day month weekday), "*/10 * * * * *" (seconds first) or "@every 30s"`,
			Read: func(v *yaml.Node, field string) (err error) {
				cronNode = v
				sc.Cron, err = p.nonEmpty(v, field, `a cron spec such as "*/5 * * * *" or "@every 30s"`)
				return err
			}},
		{Key: "timezone", Read: yamlfile.Into(&sc.Timezone, p.timezone), Check: func() error { return p.cron(sc, cronNode) }},
		{Key: "type", Missing: "give the asynq task type, such as email:send", Read: nonEmpty(&sc.Type, "the asynq task type, such as email:send")},
		{Key: "count", Read: p.IntTo(&sc.Count, 1, MaxCount)},
		{Key: "payload", Read: func(v *yaml.Node, field string) (err error) {
			payloadNode = v
			sc.Payload, err = p.payload(v, field)
			return err
		}},
		{Key: "payloads", Read: nonEmpty(&sc.Payloads, "the path of a file with one JSON payload per line"), Check: func() error {
			switch {
			case payloadNode != nil && sc.Payloads != "":
				return p.Failf(payloadNode, "payload", "cannot be combined with payloads; give one payload for every task, or a file of them")
			case sc.Count == 0 && sc.Payloads == "":
				return p.Failf(n, "count", "missing; give the number of tasks per firing (1 to %d), or a payloads file with one line per task", MaxCount)
			}
			return nil
		}},
		{Key: "queue", Read: nonEmpty(&sc.Queue, "an asynq queue name")},
		{Key: "max_retry", Read: p.IntTo(&sc.MaxRetry, 0, 1000)},
		{Key: "timeout", Read: p.DurationTo(&sc.Timeout, time.Second, 7*24*time.Hour)},
		{Key: "retention", Read: p.DurationTo(&sc.Retention, time.Second, MaxRetention)},
		{Key: "overlap", Read: yamlfile.Into(&sc.Overlap, p.overlap)},
		{Key: "pace", Read: yamlfile.Into(&sc.Pace, func(v *yaml.Node, _ string) (*PaceSpec, error) { return p.pace(v, file) })},
	}
}

// timezone reads an IANA time zone.
func (p *parser) timezone(n *yaml.Node, field string) (string, error) {
	tz, err := p.nonEmpty(n, field, "an IANA time zone such as UTC or Europe/Berlin")
	if err != nil {
		return "", err
	}
	if _, err := time.LoadLocation(tz); err != nil || strings.ContainsAny(tz, " \t\n") {
		return "", p.Failf(n, field, "%q is not a known time zone; use an IANA name such as UTC or Europe/Berlin", tz)
	}
	return tz, nil
}

// cron parses sc's cron spec, read at cn, in its time zone.
func (p *parser) cron(sc *Schedule, cn *yaml.Node) error {
	spec := sc.Cron
	if sc.Timezone != "" {
		if strings.HasPrefix(spec, "TZ=") || strings.HasPrefix(spec, "CRON_TZ=") {
			return p.Failf(cn, "cron", "%q names a time zone and so does timezone; give it once", sc.Cron)
		}
		spec = "CRON_TZ=" + sc.Timezone + " " + spec
	}
	var err error
	if sc.schedule, err = parseCron(spec); err != nil {
		return p.Failf(cn, "cron", "%q: %v; use five fields (minute hour day month weekday), six with seconds first, or a descriptor such as @hourly or @every 30s", sc.Cron, err)
	}
	if every, ok := strings.CutPrefix(strings.TrimSpace(sc.Cron), "@every "); ok {
		// robfig/cron turns anything under a second into one second.
		if d, err := time.ParseDuration(strings.TrimSpace(every)); err == nil && d < time.Second {
			return p.Failf(cn, "cron", "%q: the interval must be at least 1s", sc.Cron)
		}
	}
	return nil
}

// payload reads a payload written in YAML as its JSON.
func (p *parser) payload(n *yaml.Node, field string) ([]byte, error) {
	var x any
	if err := n.Decode(&x); err != nil {
		return nil, p.Failf(n, field, "%v", err)
	}
	b, err := json.Marshal(x)
	if err != nil {
		return nil, p.Failf(n, field, "cannot be written as JSON (%v); use a mapping with string keys, a list or a scalar", err)
	}
	return b, nil
}

// overlap reads skip or delay.
func (p *parser) overlap(n *yaml.Node, field string) (Overlap, error) {
	o, err := p.Str(n, field)
	if err != nil {
		return 0, err
	}
	switch o {
	case "skip":
		return OverlapSkip, nil
	case "delay":
		return OverlapDelay, nil
	}
	return 0, p.Failf(n, field, "%q: use skip (drop a firing while the previous batch runs) or delay (run it after)", o)
}

// pace reads a schedule's pace mapping: {} or {rule: name} for a rule of
// the workers' rules file, or an inline rule with rate.
func (p *parser) pace(n *yaml.Node, file *Schedules) (*PaceSpec, error) {
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return nil, p.Failf(n, "pace", "is empty; write pace: {} to pace under the workers' rule for the type, or give its fields")
	}
	ps := &PaceSpec{Prefix: file.Prefix}
	fields, err := p.Fields(n, "pace", "pace", []yamlfile.Field{
		{Key: "rule", Read: yamlfile.Into(&ps.Rule, p.ruleName)},
		{Key: "rate"}, {Key: "burst"}, {Key: "algorithm"}, {Key: "subject"}, // inlinePace
		{Key: "keep", Read: p.DurationTo(&ps.Keep, time.Second, 10*365*24*time.Hour)},
		{Key: "lead", Read: p.DurationTo(&ps.Lead, 0, time.Minute)},
	})
	if err != nil {
		return nil, err
	}
	if fields["rate"] != nil {
		return ps, p.inlinePace(n, fields, ps)
	}
	for _, f := range inlineOnly {
		if v := fields[f]; v != nil {
			return nil, p.Failf(v, "pace."+f, "comes from the workers' rules file; remove it, or give rate (and rule, subject) for an inline rule")
		}
	}
	if file.Rules == "" {
		return nil, p.Failf(n, "pace", "needs the workers' rules file: set rules: at the top of the file, or give rate, rule and subject for an inline rule")
	}
	return ps, nil
}

// ruleName reads the name of a workers' rule.
func (p *parser) ruleName(n *yaml.Node, field string) (string, error) {
	name, err := p.Str(n, field)
	if err == nil && !yamlfile.ValidName(name) {
		err = p.Failf(n, field, "%q: use the name of the workers' rule (%s)", name, yamlfile.NameRule)
	}
	return name, err
}

// inlinePace reads the inline rule of the pace mapping n (fields by key)
// into ps: the workers' rule spelled out.
func (p *parser) inlinePace(n *yaml.Node, fields map[string]*yaml.Node, ps *PaceSpec) error {
	if fields["rule"] == nil {
		return p.Failf(n, "pace.rule", "missing; an inline rule needs the name the workers' rules file gives it (the last part of its Redis key)")
	}
	burst, rate := 1, fields["rate"]
	if v := fields["burst"]; v != nil {
		var err error
		if burst, err = p.Int(v, "pace.burst", 1, math.MaxInt64); err != nil {
			return err
		}
	}
	rs, err := p.Str(rate, "pace.rate")
	if err != nil {
		return err
	}
	if ps.Limit, err = ParseRate(rs, burst); err != nil {
		return p.Failf(rate, "pace.rate", "%v", err)
	}
	ps.Algorithm = throttle.GCRA
	if v := fields["algorithm"]; v != nil {
		as, err := p.Str(v, "pace.algorithm")
		if err != nil {
			return err
		}
		if ps.Algorithm, err = rules.ParseAlgorithm(as); err != nil {
			return p.Failf(v, "pace.algorithm", "%q: use %s", as, rules.AlgorithmNames(rules.PaceAlgorithms()))
		}
	}
	sn := fields["subject"]
	if sn == nil {
		return p.Failf(n, "pace.subject", "missing; %s, as the workers' rule does", yamlfile.SubjectHelp)
	}
	if ps.Subject.Fixed, ps.Subject.PayloadField, err = p.Subject(sn, "pace.subject"); err != nil {
		return err
	}
	if err := (throttle.Rule{Name: ps.Rule, Algorithm: ps.Algorithm, Limit: ps.Limit}).Validate(); err != nil {
		return p.Failf(rate, "pace.rate", "%v", strings.TrimPrefix(err.Error(), "throttle: "))
	}
	return nil
}

// peekName returns the value of a mapping's name field, or "".
func peekName(n *yaml.Node) string {
	if n.Kind != yaml.MappingNode {
		return ""
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k, v := yamlfile.Resolve(n.Content[i]), yamlfile.Resolve(n.Content[i+1]); k.Value == "name" && v.Kind == yaml.ScalarNode {
			return v.Value
		}
	}
	return ""
}

// parseCron parses a spec; robfig/cron panics on a few malformed specs,
// which are errors here.
func parseCron(spec string) (s cron.Schedule, err error) {
	defer func() {
		if r := recover(); r != nil {
			s, err = nil, fmt.Errorf("malformed spec (%v)", r)
		}
	}()
	return cronParser.Parse(spec)
}

// nonEmpty reads a string that must not be empty; what says what it is.
func (p *parser) nonEmpty(n *yaml.Node, field, what string) (string, error) {
	s, err := p.Str(n, field)
	if err != nil {
		return "", err
	}
	if strings.TrimSpace(s) == "" {
		return "", p.Failf(n, field, "is empty; give %s", what)
	}
	return s, nil
}
