package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// The features part measures issue 24's new rules as the backlog part
// does the plain one: a backlog enqueued at once to asynq servers in this
// process on a throwaway redis-server, each task once, every limit held,
// and limiter calls and parks per task against the backlog's size.
//   - within-tenant: one tenant's tasks over three API keys, a per-key
//     rule within the tenant's, the keys together asking twice what the
//     tenant allows (the tenant binds);
//   - within-key: the same with keys slower than the tenant (they bind);
//   - priority: one subject, 90 % of level 0 enqueued first, then 10 % of
//     level 9;
//   - calendar: a daily quota (UTC) beside a per-second limit in one
//     policy; 10 % of the tasks more than the quota wait in the line for
//     the next day, and the calls they cost while they wait are counted.

// featuresResult is the part's JSON: results/<date>-features.json.
type featuresResult struct {
	partHead
	Config   featuresConfig `json:"config"`
	RuntimeS float64        `json:"runtime_s"`
	Runs     []*featureRun  `json:"runs"`
	Errors   []string       `json:"errors,omitempty"`
}

type featuresConfig struct {
	Servers     int           `json:"servers"`
	Concurrency int           `json:"concurrency"` // per server
	MaxWaitS    float64       `json:"max_wait_s"`
	Cases       []featureSize `json:"cases"`
	CapFactor   float64       `json:"cap_factor"`
	CapSlackS   float64       `json:"cap_slack_s"`
	// QuietS is how long the calendar case watches the tasks past the
	// quota wait, counting the limiter calls.
	QuietS float64 `json:"quiet_s"`
	// Only, if set, is the features run, comma-separated.
	Only string `json:"only,omitempty"`
	// MaxRate, if above 0, bounds each case's rate (else N/20 a second).
	MaxRate int `json:"max_rate,omitempty"`
	Nice    int `json:"nice"`
}

// featureSize is one case: N tasks of a feature, Rate the binding limit's
// per second (the tenant's; the keys' for within-key).
type featureSize struct {
	Feature string `json:"feature"`
	N       int    `json:"n"`
	Rate    int    `json:"rate"`
}

// The features' names (featureSize.Feature).
const (
	featWithinTenant = "within-tenant"
	featWithinKey    = "within-key"
	featWithinNested = "within-nested" // within-tenant, nested: true (the tenant's rule, each key a share limited by the key's)
	featPriority     = "priority"
	featCalendar     = "calendar"
)

// withinKeys is how many API keys share the tenant in the within cases.
const withinKeys = 3

// featureRun is one case's result.
type featureRun struct {
	featureSize
	Servers     int     `json:"servers"`
	Concurrency int     `json:"concurrency"`
	IdealS      float64 `json:"ideal_s"` // N / Rate (the quota's N for calendar)
	CapS        float64 `json:"cap_s"`
	Done        int     `json:"done"` // distinct tasks started
	Finished    bool    `json:"finished"`
	TookS       float64 `json:"took_s"` // first enqueue to the last start
	counts
	// Most starts in any 1 s (local clock) of the tenant / the one
	// subject, and its bound (limit + burst); for within, the most turns
	// of one key in any 1 s on the Redis clock, and the key's bound.
	MaxStarts1s   int `json:"max_starts_1s"`
	MaxTurns1s    int `json:"max_turns_1s"` // on the Redis clock, the task's own rule's turns (-1: none)
	Bound1s       int `json:"bound_1s"`
	MaxKeyTurns1s int `json:"max_key_turns_1s,omitempty"`
	KeyBound1s    int `json:"key_bound_1s,omitempty"`
	// Priority: from enqueue to start, the high tasks' p50 and max, the
	// low tasks' p50, and how many lows started after the first high.
	HighP50S      float64 `json:"high_p50_s,omitempty"`
	HighMaxS      float64 `json:"high_max_s,omitempty"`
	LowP50S       float64 `json:"low_p50_s,omitempty"`
	LowsAfterHigh int     `json:"lows_after_first_high,omitempty"`
	// Calendar: the tasks past the quota, those of them that started (0:
	// the quota held), and the limiter calls in the QuietS after the
	// quota's tasks ran, per second.
	Extra           int     `json:"extra,omitempty"`
	ExtraStarted    int     `json:"extra_started,omitempty"`
	QuietCallsPerS  float64 `json:"quiet_calls_per_s,omitempty"`
	QuietCallsTotal int64   `json:"quiet_calls,omitempty"`
}

// defaultFeaturesConfig is the part's configuration for backlogs of each
// of sizes, each at size/20 tasks a second (about 20 s a case), at most
// maxRate if it is above 0 (a larger backlog then takes longer).
func defaultFeaturesConfig(maxRate int, sizes ...int) featuresConfig {
	var cases []featureSize
	for _, n := range sizes {
		rate := max(n/20, 3)
		if maxRate > 0 {
			rate = min(rate, max(maxRate, 3))
		}
		cases = append(cases,
			featureSize{featWithinTenant, n, rate}, featureSize{featWithinNested, n, rate}, featureSize{featWithinKey, n, rate},
			featureSize{featPriority, n, rate}, featureSize{featCalendar, n, rate})
	}
	return featuresConfig{Servers: 3, Concurrency: 20, MaxWaitS: 1, Cases: cases, CapFactor: 2, CapSlackS: 10, QuietS: 5, Nice: niceness}
}

// runFeaturesPart runs the part and writes results/<date>-features.json.
func runFeaturesPart(logf func(string, ...any), cfg featuresConfig) error {
	t0 := time.Now()
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &featuresResult{partHead: head, Config: cfg}
	for _, c := range cfg.Cases {
		if cfg.Only != "" && !slices.Contains(strings.Split(cfg.Only, ","), c.Feature) {
			continue
		}
		r, err := runFeatureCase(context.Background(), srv.Addr, c, cfg)
		if err != nil {
			res.Errors = append(res.Errors, fmt.Sprintf("%s N=%d: %v", c.Feature, c.N, err))
			logf("features %s N=%d: %v", c.Feature, c.N, err)
			continue
		}
		logf("features %-13s N=%-5d R=%-3d done %d/%d in %.1fs (ideal %.0fs): %.3f calls, %.3f parks per task, %d duplicate starts; most in 1 s %d starts, %d turns (bound %d), a key's turns %d (bound %d); highs p50 %.2fs max %.2fs, lows p50 %.2fs, %d lows after the first high; extra %d, %d started, %.1f calls/s waiting",
			r.Feature, r.N, r.Rate, r.Done, r.N, r.TookS, r.IdealS, r.CallsPerTask, r.ParksPerTask, r.DuplicateStarts, r.MaxStarts1s, r.MaxTurns1s, r.Bound1s,
			r.MaxKeyTurns1s, r.KeyBound1s, r.HighP50S, r.HighMaxS, r.LowP50S, r.LowsAfterHigh, r.Extra, r.ExtraStarted, r.QuietCallsPerS)
		res.Runs = append(res.Runs, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, featuresName(t0, cfg), res)
}

// featuresName is the part's name in its results file: features, then
// the one feature run and the sizes if not the default; with the time of
// day too if a file of that name exists, so that no run overwrites
// another's.
func featuresName(t0 time.Time, cfg featuresConfig) string {
	name := "features"
	if cfg.Only != "" {
		name += "-" + cfg.Only
	}
	var sizes []string
	for _, c := range cfg.Cases {
		if s := fmt.Sprint(c.N); !slices.Contains(sizes, s) {
			sizes = append(sizes, s)
		}
	}
	if s := strings.Join(sizes, "-"); s != "300-3000" {
		name += "-" + s
	}
	if _, err := os.Stat(filepath.Join("results", t0.UTC().Format("2006-01-02")+"-"+name+".json")); err == nil {
		name += t0.UTC().Format("-150405")
	}
	return name
}

// featureRules returns the rules of case c, built on limRDB under prefix.
func featureRules(c featureSize, limRDB *redis.Client, prefix string) ([]worker.TaskRule, error) {
	var rules []worker.TaskRule
	add := func(tr worker.TaskRule, lrs ...throttle.Rule) error {
		lim, err := throttle.New(limRDB, throttle.Options{Prefix: prefix}, lrs...)
		tr.Limiter = lim
		rules = append(rules, tr)
		return err
	}
	var err error
	switch c.Feature {
	case featWithinTenant, featWithinKey, featWithinNested:
		key, tenant := withinLimits(c)
		if c.Feature == featWithinNested {
			// As the rules file builds a rule with nested: true
			// (rules.RuleConfig.Nested): the tenant's limit, in a line of
			// the key rule's own, each key a share limited by the key's.
			lim, lerr := throttle.New(limRDB, throttle.Options{Prefix: prefix, Line: "key"}, gcraRule("tenant", tenant))
			rules = append(rules, worker.TaskRule{Name: "key", Tasks: []string{"job:*"}, Subject: worker.PayloadField("tenant"), FairBy: worker.PayloadField("key"),
				Limiter: lim, Settings: admission.Settings{ShareLimit: throttle.PerSecond(key).WithBurst(1)}})
			err = lerr
		} else {
			err = add(worker.TaskRule{Name: "key", Tasks: []string{"job:*"}, Subject: worker.PayloadField("key"), Within: "tenant"}, gcraRule("key", key))
		}
		if err == nil {
			err = add(worker.TaskRule{Name: "tenant", Tasks: []string{"tenant:*"}, Subject: worker.PayloadField("tenant")}, gcraRule("tenant", tenant))
		}
	case featPriority:
		err = add(worker.TaskRule{Name: "api", Tasks: []string{"job:*"}, Subject: worker.PayloadField("tenant"), Priority: worker.PayloadPriority("p")}, gcraRule("api", c.Rate))
	case featCalendar:
		err = add(worker.TaskRule{Name: "api", Tasks: []string{"job:*"}, Subject: worker.PayloadField("tenant")}, gcraRule("api", c.Rate),
			throttle.Rule{Name: "daily", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: c.N}, Calendar: throttle.Daily(time.UTC)})
	default:
		err = fmt.Errorf("no feature %q", c.Feature)
	}
	for i := range rules {
		rules[i].Settings.MaxWait = admission.DefaultMaxWait
	}
	return rules, err
}

// featurePayload is task i's payload in case c (of n tasks enqueued).
func featurePayload(c featureSize, n int) func(i int) []byte {
	return func(i int) []byte {
		switch c.Feature {
		case featWithinTenant, featWithinKey, featWithinNested:
			return fmt.Appendf(nil, `{"tenant":"acme","key":"k%d"}`, i%withinKeys)
		case featPriority:
			p := 0
			if i >= n*9/10 {
				p = admission.MaxPriority
			}
			return fmt.Appendf(nil, `{"tenant":"acme","p":%d}`, p)
		}
		return []byte(`{"tenant":"acme"}`)
	}
}

// runFeatureCase enqueues case c at once to cfg.Servers workers and waits
// until its tasks have started, or the cap.
func runFeatureCase(ctx context.Context, addr string, c featureSize, cfg featuresConfig) (*featureRun, error) {
	spec := fleetSpec{mode: modeParking, rule: gcraRule("unused", 1), prefix: "ft", concurrency: cfg.Concurrency,
		taskRules: func(limRDB *redis.Client, prefix string) ([]worker.TaskRule, error) {
			return featureRules(c, limRDB, prefix)
		}}
	f, before, err := openFleet(ctx, addr, spec, cfg.Servers)
	if err != nil {
		return nil, err
	}
	defer f.close()
	n, runs := c.N, c.N // tasks enqueued; tasks that should run
	r := &featureRun{featureSize: c, Servers: cfg.Servers, Concurrency: cfg.Concurrency, IdealS: float64(c.N) / float64(c.Rate), Bound1s: c.Rate + 1}
	if c.Feature == featCalendar {
		r.Extra = c.N / 10
		n += r.Extra
	}
	r.CapS = r.IdealS*cfg.CapFactor + cfg.CapSlackS
	t0 := time.Now()
	if err := f.enqueueEach(ctx, n, featurePayload(c, n), c.Feature == featPriority); err != nil {
		return nil, err
	}
	r.Finished = f.waitStarts(runs, t0.Add(secs(r.CapS)))
	if c.Feature == featCalendar {
		calls := f.calls.Load()
		time.Sleep(secs(cfg.QuietS))
		r.QuietCallsTotal = f.calls.Load() - calls
		r.QuietCallsPerS = float64(r.QuietCallsTotal) / cfg.QuietS
	}
	starts, err := f.finish(ctx, n, before, &r.counts, &r.Done)
	if err != nil {
		return nil, err
	}
	r.TookS = r.CapS
	if r.Finished {
		r.TookS = nthStart(starts, runs).Sub(t0).Seconds()
	}
	r.MaxStarts1s, r.MaxTurns1s = mostInSecond(starts, "", time.Time{})
	switch c.Feature {
	case featWithinTenant, featWithinKey, featWithinNested:
		r.withinKeys(starts)
	case featPriority:
		r.priorityOrder(f, starts)
	case featCalendar:
		r.ExtraStarted = max(r.Done-runs, 0)
	}
	return r, nil
}

// nthStart is the k-th start in time (the last if fewer).
func nthStart(starts []taskStart, k int) time.Time {
	at := make([]time.Time, len(starts))
	for i, s := range starts {
		at[i] = s.at
	}
	slices.SortFunc(at, time.Time.Compare)
	if len(at) == 0 {
		return time.Time{}
	}
	return at[min(k, len(at))-1]
}

// withinLimits returns the per-key and the per-tenant limit of a within
// case, per second, Rate being what binds: within-tenant, the tenant's
// Rate, the keys together asking twice that; within-key, the three keys
// together Rate, within a tenant of twice that.
func withinLimits(c featureSize) (key, tenant int) {
	if c.Feature == featWithinTenant || c.Feature == featWithinNested {
		return max(2*c.Rate/withinKeys, 1), c.Rate
	}
	return max(c.Rate/withinKeys, 1), 2 * c.Rate
}

// withinKeys sets the most turns of one key in any 1 s (Redis clock) and
// its bound (each start's Wait is its own rule's, the key's), and the
// bound of the tenant's starts.
func (r *featureRun) withinKeys(starts []taskStart) {
	key, tenant := withinLimits(r.featureSize)
	r.Bound1s = min(tenant+1, withinKeys*(key+1))
	r.KeyBound1s = key + 1
	for k := range withinKeys {
		subject := fmt.Sprintf("k%d", k)
		of := starts
		switch r.Feature {
		case featWithinNested: // one subject, the tenant: a key is a share
			of = nil
			for _, s := range starts {
				if s.key == subject {
					of = append(of, s)
				}
			}
			subject = ""
		}
		_, most := mostInSecond(of, subject, time.Time{})
		r.MaxKeyTurns1s = max(r.MaxKeyTurns1s, most)
	}
}

// priorityOrder sets the priority case's waits: from enqueue to start, of
// the high tasks and the low ones.
func (r *featureRun) priorityOrder(f *fleet, starts []taskStart) {
	var high, low []int64
	var firstHigh time.Time
	f.mu.Lock()
	for _, s := range starts {
		w := int64(s.at.Sub(f.enqueued[s.id]))
		if s.prio > 0 {
			high = append(high, w)
			if firstHigh.IsZero() || s.at.Before(firstHigh) {
				firstHigh = s.at
			}
		} else {
			low = append(low, w)
		}
	}
	f.mu.Unlock()
	for _, s := range starts {
		if s.prio == 0 && s.at.After(firstHigh) {
			r.LowsAfterHigh++
		}
	}
	slices.Sort(high)
	slices.Sort(low)
	r.HighP50S, r.HighMaxS = float64(percentile(high, 50))/1e9, float64(percentile(high, 100))/1e9
	r.LowP50S = float64(percentile(low, 50)) / 1e9
}

// runFeatures runs the features part for sizes ("300,3000"), only one
// feature if only is not empty, each size's rate at most maxRate (0: no
// bound).
func runFeatures(logf func(string, ...any), sizes, only string, maxRate int) error {
	ns, err := parseSizes(sizes)
	if err != nil {
		return err
	}
	cfg := defaultFeaturesConfig(maxRate, ns...)
	cfg.Only, cfg.MaxRate = only, maxRate
	return runFeaturesPart(logf, cfg)
}

// parseSizes reads "300,3000".
func parseSizes(s string) ([]int, error) {
	var sizes []int
	for _, f := range strings.Split(s, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(f), &n); err != nil || n < 10 {
			return nil, fmt.Errorf("bench: -feature-sizes %q: each size a whole number of at least 10", s)
		}
		sizes = append(sizes, n)
	}
	return sizes, nil
}
