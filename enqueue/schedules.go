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
	fileFields     = []string{"rules", "prefix", "schedules"}
	scheduleFields = []string{"name", "cron", "timezone", "type", "count", "payload", "payloads", "queue", "max_retry", "timeout", "retention", "overlap", "pace"}
	paceFields     = []string{"rule", "rate", "burst", "algorithm", "subject", "keep", "lead"}
	inlineOnly     = []string{"burst", "algorithm", "subject"}
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
		probe.Pacer = &Pacer{Subject: subject, Cost: cost}
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
	fields, err := p.Mapping(root, "", "the file", fileFields)
	if err != nil {
		return nil, err
	}
	s := &Schedules{File: p.file, Prefix: throttle.DefaultPrefix}
	if n := fields["rules"]; n != nil {
		if s.Rules, err = p.nonEmpty(n, "rules", "the path of the workers' rules file"); err != nil {
			return nil, err
		}
	}
	if n := fields["prefix"]; n != nil {
		if s.Prefix, err = p.Prefix(n, "prefix", throttle.DefaultPrefix); err != nil {
			return nil, err
		}
	}
	list := fields["schedules"]
	if list == nil {
		return nil, p.Failf(root, "schedules", "missing; list at least one schedule")
	}
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
	fields, err := p.Mapping(n, "", "a schedule", scheduleFields)
	if err != nil {
		return Schedule{}, err
	}
	sc := Schedule{Line: n.Line, MaxRetry: -1}

	if sc.Name, err = p.Name(n, fields["name"], "name", "the schedule", "schedule", "", names); err != nil {
		return sc, err
	}
	p.schedule = sc.Name

	if v := fields["timezone"]; v != nil {
		if sc.Timezone, err = p.nonEmpty(v, "timezone", "an IANA time zone such as UTC or Europe/Berlin"); err != nil {
			return sc, err
		}
		if _, err := time.LoadLocation(sc.Timezone); err != nil || strings.ContainsAny(sc.Timezone, " \t\n") {
			return sc, p.Failf(v, "timezone", "%q is not a known time zone; use an IANA name such as UTC or Europe/Berlin", sc.Timezone)
		}
	}
	cn := fields["cron"]
	if cn == nil {
		return sc, p.Failf(n, "cron", `missing; give a cron spec such as "*/5 * * * *" (minute hour day month weekday), "*/10 * * * * *" (seconds first) or "@every 30s"`)
	}
	if sc.Cron, err = p.nonEmpty(cn, "cron", `a cron spec such as "*/5 * * * *" or "@every 30s"`); err != nil {
		return sc, err
	}
	spec := sc.Cron
	if sc.Timezone != "" {
		if strings.HasPrefix(spec, "TZ=") || strings.HasPrefix(spec, "CRON_TZ=") {
			return sc, p.Failf(cn, "cron", "%q names a time zone and so does timezone; give it once", sc.Cron)
		}
		spec = "CRON_TZ=" + sc.Timezone + " " + spec
	}
	if sc.schedule, err = parseCron(spec); err != nil {
		return sc, p.Failf(cn, "cron", "%q: %v; use five fields (minute hour day month weekday), six with seconds first, or a descriptor such as @hourly or @every 30s", sc.Cron, err)
	}
	if every, ok := strings.CutPrefix(strings.TrimSpace(sc.Cron), "@every "); ok {
		// robfig/cron turns anything under a second into one second.
		if d, err := time.ParseDuration(strings.TrimSpace(every)); err == nil && d < time.Second {
			return sc, p.Failf(cn, "cron", "%q: the interval must be at least 1s", sc.Cron)
		}
	}

	tn := fields["type"]
	if tn == nil {
		return sc, p.Failf(n, "type", "missing; give the asynq task type, such as email:send")
	}
	if sc.Type, err = p.nonEmpty(tn, "type", "the asynq task type, such as email:send"); err != nil {
		return sc, err
	}

	if v := fields["payload"]; v != nil {
		if fields["payloads"] != nil {
			return sc, p.Failf(v, "payload", "cannot be combined with payloads; give one payload for every task, or a file of them")
		}
		var x any
		if err := v.Decode(&x); err != nil {
			return sc, p.Failf(v, "payload", "%v", err)
		}
		if sc.Payload, err = json.Marshal(x); err != nil {
			return sc, p.Failf(v, "payload", "cannot be written as JSON (%v); use a mapping with string keys, a list or a scalar", err)
		}
	}
	if v := fields["payloads"]; v != nil {
		if sc.Payloads, err = p.nonEmpty(v, "payloads", "the path of a file with one JSON payload per line"); err != nil {
			return sc, err
		}
	}
	if v := fields["count"]; v != nil {
		if sc.Count, err = p.Int(v, "count", 1, MaxCount); err != nil {
			return sc, err
		}
	} else if sc.Payloads == "" {
		return sc, p.Failf(n, "count", "missing; give the number of tasks per firing (1 to %d), or a payloads file with one line per task", MaxCount)
	}
	if v := fields["queue"]; v != nil {
		if sc.Queue, err = p.nonEmpty(v, "queue", "an asynq queue name"); err != nil {
			return sc, err
		}
	}
	if v := fields["max_retry"]; v != nil {
		if sc.MaxRetry, err = p.Int(v, "max_retry", 0, 1000); err != nil {
			return sc, err
		}
	}
	if v := fields["timeout"]; v != nil {
		if sc.Timeout, err = p.Duration(v, "timeout", time.Second, 7*24*time.Hour); err != nil {
			return sc, err
		}
	}
	if v := fields["retention"]; v != nil {
		if sc.Retention, err = p.Duration(v, "retention", time.Second, MaxRetention); err != nil {
			return sc, err
		}
	}
	if v := fields["overlap"]; v != nil {
		o, err := p.Str(v, "overlap")
		if err != nil {
			return sc, err
		}
		switch o {
		case "skip":
			sc.Overlap = OverlapSkip
		case "delay":
			sc.Overlap = OverlapDelay
		default:
			return sc, p.Failf(v, "overlap", "%q: use skip (drop a firing while the previous batch runs) or delay (run it after)", o)
		}
	}
	if v := fields["pace"]; v != nil {
		if sc.Pace, err = p.pace(v, file); err != nil {
			return sc, err
		}
	}
	return sc, nil
}

// pace reads a schedule's pace mapping: {} or {rule: name} for a rule of
// the workers' rules file, or an inline rule with rate.
func (p *parser) pace(n *yaml.Node, file *Schedules) (*PaceSpec, error) {
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return nil, p.Failf(n, "pace", "is empty; write pace: {} to pace under the workers' rule for the type, or give its fields")
	}
	fields, err := p.Mapping(n, "pace", "pace", paceFields)
	if err != nil {
		return nil, err
	}
	ps := &PaceSpec{Prefix: file.Prefix}
	if v := fields["rule"]; v != nil {
		if ps.Rule, err = p.Str(v, "pace.rule"); err != nil {
			return nil, err
		}
		if !yamlfile.ValidName(ps.Rule) {
			return nil, p.Failf(v, "pace.rule", "%q: use the name of the workers' rule (%s)", ps.Rule, yamlfile.NameRule)
		}
	}
	if v := fields["keep"]; v != nil {
		if ps.Keep, err = p.Duration(v, "pace.keep", time.Second, (10 * 365 * 24 * time.Hour)); err != nil {
			return nil, err
		}
	}
	if v := fields["lead"]; v != nil {
		if ps.Lead, err = p.Duration(v, "pace.lead", 0, time.Minute); err != nil {
			return nil, err
		}
	}
	rate := fields["rate"]
	if rate == nil {
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
	// Inline: the workers' rule spelled out.
	if fields["rule"] == nil {
		return nil, p.Failf(n, "pace.rule", "missing; an inline rule needs the name the workers' rules file gives it (the last part of its Redis key)")
	}
	burst := 1
	if v := fields["burst"]; v != nil {
		if burst, err = p.Int(v, "pace.burst", 1, math.MaxInt64); err != nil {
			return nil, err
		}
	}
	rs, err := p.Str(rate, "pace.rate")
	if err != nil {
		return nil, err
	}
	if ps.Limit, err = ParseRate(rs, burst); err != nil {
		return nil, p.Failf(rate, "pace.rate", "%v", err)
	}
	ps.Algorithm = throttle.GCRA
	if v := fields["algorithm"]; v != nil {
		as, err := p.Str(v, "pace.algorithm")
		if err != nil {
			return nil, err
		}
		a, err := rules.ParseAlgorithm(as)
		if err != nil {
			return nil, p.Failf(v, "pace.algorithm", "%q: use gcra (leaky_bucket), token_bucket, fixed_window, sliding_log or sliding_window", as)
		}
		ps.Algorithm = a
	}
	sn := fields["subject"]
	if sn == nil {
		return nil, p.Failf(n, "pace.subject", "missing; %s, as the workers' rule does", yamlfile.SubjectHelp)
	}
	if ps.Subject.Fixed, ps.Subject.PayloadField, err = p.Subject(sn, "pace.subject"); err != nil {
		return nil, err
	}
	if err := (throttle.Rule{Name: ps.Rule, Algorithm: ps.Algorithm, Limit: ps.Limit}).Validate(); err != nil {
		return nil, p.Failf(rate, "pace.rate", "%v", strings.TrimPrefix(err.Error(), "throttle: "))
	}
	return ps, nil
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
