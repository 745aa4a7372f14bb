package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The upstream part: a fake third-party API whose limit L the fleet's
// configuration does not know and which changes mid-run. With headers,
// the API announces its policy (RateLimit-Policy, RateLimit) and the
// fleet's httpthrottle.Transport learns it; without, it only answers 429 with
// Retry-After, and the Transport can only pause.

// upstreamConfig is the part's setup, the same for both scenarios.
type upstreamConfig struct {
	Phases      []upstreamPhase `json:"phases"`       // L over time
	Workers     int             `json:"workers"`      // Transports, each with its own Redis client and Limiter
	Goroutines  int             `json:"goroutines"`   // sending through each Transport
	Configured  int             `json:"configured"`   // the fleet's configured limit, requests/s (GCRA, burst 1)
	LatencyMS   float64         `json:"latency_ms"`   // the API's answer time
	BinMS       int             `json:"bin_ms"`       // resolution of the reach measure
	SettleS     float64         `json:"settle_s"`     // left out of each phase's steady figures
	ReachWithin float64         `json:"reach_within"` // the share of L a 1 s window must reach
}

// upstreamPhase is one stretch of the run at one limit.
type upstreamPhase struct {
	L         int     `json:"l"`          // requests per second the API accepts (fixed 1 s windows)
	DurationS float64 `json:"duration_s"` // how long
}

// upstreamResult is one scenario's outcome.
type upstreamResult struct {
	Name     string               `json:"name"`
	Headers  bool                 `json:"headers"` // the API announced its policy
	Requests int                  `json:"requests"`
	TooMany  int                  `json:"too_many"` // answered 429
	Phases   []upstreamPhaseStats `json:"phases"`
}

// upstreamPhaseStats are a phase's figures on the API's side.
type upstreamPhaseStats struct {
	L int `json:"l"`
	// SteadyOK is accepted requests per second after SettleS, as a share
	// of L.
	SteadyShare float64 `json:"steady_share"`
	Requests    int     `json:"requests"`
	TooMany     int     `json:"too_many"`
	// ReachS is how long after the phase began the accepted requests in a
	// sliding 1 s window first reached ReachWithin × L; -1 if never.
	ReachS float64 `json:"reach_s"`
	// Accepted are the accepted requests in each whole second of the
	// phase.
	Accepted []int `json:"accepted"`
}

// upstreamRun is the results file of the part.
type upstreamRun struct {
	partHead
	Config    upstreamConfig   `json:"config"`
	Scenarios []upstreamResult `json:"scenarios"`
}

// fakeAPI accepts L requests in each whole second since its start and
// answers 429 beyond, with Retry-After to the next second; with headers,
// every answer carries its policy and what remains.
type fakeAPI struct {
	start   time.Time
	phases  []upstreamPhase
	headers bool
	latency time.Duration

	mu     sync.Mutex
	second int
	used   int
	log    []apiHit
}

type apiHit struct {
	at time.Duration
	ok bool
}

// limitAt is L at offset d.
func (a *fakeAPI) limitAt(d time.Duration) int {
	end := 0.0
	for _, p := range a.phases {
		end += p.DurationS
		if d.Seconds() < end {
			return p.L
		}
	}
	return a.phases[len(a.phases)-1].L
}

func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	time.Sleep(a.latency)
	d := time.Since(a.start)
	l := a.limitAt(d)
	a.mu.Lock()
	sec := int(d / time.Second)
	if sec != a.second {
		a.second, a.used = sec, 0
	}
	ok := a.used < l
	if ok {
		a.used++
	}
	remaining := l - a.used
	a.log = append(a.log, apiHit{at: d, ok: ok})
	a.mu.Unlock()
	reset := int(math.Ceil((time.Duration(sec+1)*time.Second - d).Seconds()))
	if a.headers {
		w.Header().Set("RateLimit-Policy", `"default";q=`+strconv.Itoa(l)+`;w=1`)
		w.Header().Set("RateLimit", `"default";r=`+strconv.Itoa(remaining)+`;t=`+strconv.Itoa(reset))
	}
	if !ok {
		w.Header().Set("Retry-After", strconv.Itoa(reset))
		w.WriteHeader(http.StatusTooManyRequests)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// runUpstream runs both scenarios on a fresh redis-server and writes
// results/<date>-upstream.json, then the report.
func runUpstream(mdPath string, logf func(string, ...any)) error {
	t0 := time.Now()
	cfg := upstreamConfig{
		Phases:     []upstreamPhase{{L: 100, DurationS: 10}, {L: 50, DurationS: 10}, {L: 150, DurationS: 10}},
		Workers:    4,
		Goroutines: 8,
		Configured: 1000,
		LatencyMS:  2,
		BinMS:      100,
		SettleS:    2,
		// The 2 s claim: a 1 s window at 90 % of the new L, ending
		// within 2 s of the change.
		ReachWithin: 0.9,
	}
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	run := &upstreamRun{partHead: head, Config: cfg}
	for i, headers := range []bool{true, false} {
		name := "learned from RateLimit headers"
		if !headers {
			name = "Retry-After only (pause)"
		}
		logf("upstream: %s", name)
		res, err := upstreamScenario(srv.Addr, cfg, headers, fmt.Sprintf("bench-upstream-%d-%d:", t0.UnixNano(), i))
		if err != nil {
			return err
		}
		res.Name = name
		run.Scenarios = append(run.Scenarios, *res)
	}
	run.Machine.LoadEnd = loadavg()
	b, err := json.MarshalIndent(run, "", "  ")
	if err != nil {
		return err
	}
	path := filepath.Join("results", t0.UTC().Format("2006-01-02")+"-upstream.json")
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	logf("upstream: wrote %s", path)
	full, err := latestFullResults()
	if err != nil {
		return err
	}
	return regenerate(full, mdPath)
}

// upstreamScenario runs the fleet against a fakeAPI for the phases.
func upstreamScenario(addr string, cfg upstreamConfig, headers bool, prefix string) (*upstreamResult, error) {
	api := &fakeAPI{phases: cfg.Phases, headers: headers, latency: time.Duration(cfg.LatencyMS * float64(time.Millisecond)), second: -1}
	hs := httptest.NewUnstartedServer(api)
	hs.Config.ReadHeaderTimeout = 5 * time.Second
	hs.Start()
	defer hs.Close()
	total := 0.0
	for _, p := range cfg.Phases {
		total += p.DurationS
	}
	var clients []*http.Client
	var rdbs []*redis.Client
	defer func() {
		for _, r := range rdbs {
			_ = r.Close()
		}
	}()
	for range cfg.Workers {
		rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: cfg.Goroutines + 4})
		rdbs = append(rdbs, rdb)
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix},
			throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(cfg.Configured).WithBurst(1)})
		if err != nil {
			return nil, err
		}
		tr, err := httpthrottle.New(lim, httpthrottle.Options{Base: &http.Transport{MaxIdleConnsPerHost: cfg.Goroutines * 2}})
		if err != nil {
			return nil, err
		}
		clients = append(clients, &http.Client{Transport: tr})
	}
	api.start = time.Now()
	ctx, cancel := context.WithDeadline(context.Background(), api.start.Add(time.Duration(total*float64(time.Second))))
	defer cancel()
	var wg sync.WaitGroup
	for _, c := range clients {
		for range cfg.Goroutines {
			wg.Go(func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, hs.URL+"/v1/x", nil)
					resp, err := c.Do(req)
					if err != nil {
						continue
					}
					_ = resp.Body.Close()
				}
			})
		}
	}
	wg.Wait()

	api.mu.Lock()
	hits := slices.Clone(api.log)
	api.mu.Unlock()
	res := &upstreamResult{Headers: headers}
	start := 0.0
	for _, p := range cfg.Phases {
		end := start + p.DurationS
		st := upstreamPhaseStats{L: p.L, ReachS: -1, Accepted: make([]int, int(math.Ceil(p.DurationS)))}
		bins := make([]int, int(math.Round(p.DurationS*1000))/cfg.BinMS)
		steadyOK := 0
		for _, h := range hits {
			s := h.at.Seconds()
			if s < start || s >= end {
				continue
			}
			st.Requests++
			if !h.ok {
				st.TooMany++
				continue
			}
			if s >= start+cfg.SettleS {
				steadyOK++
			}
			st.Accepted[min(int(s-start), len(st.Accepted)-1)]++
			if i := int((s - start) * 1000 / float64(cfg.BinMS)); i < len(bins) {
				bins[i]++
			}
		}
		st.SteadyShare = float64(steadyOK) / (p.DurationS - cfg.SettleS) / float64(p.L)
		per := 1000 / cfg.BinMS
		for i := 0; i+per <= len(bins); i++ {
			sum := 0
			for _, n := range bins[i : i+per] {
				sum += n
			}
			if float64(sum) >= cfg.ReachWithin*float64(p.L) {
				st.ReachS = float64((i+per)*cfg.BinMS) / 1000
				break
			}
		}
		res.Requests += st.Requests
		res.TooMany += st.TooMany
		res.Phases = append(res.Phases, st)
		start = end
	}
	return res, nil
}

// latestFullResults is the newest results/<date>.json: the run
// BENCHMARKS.md is generated from.
func latestFullResults() (string, error) {
	names, _ := filepath.Glob(filepath.Join("results", "*.json"))
	re := regexp.MustCompile(`^\d{4}-\d{2}-\d{2}\.json$`)
	best := ""
	for _, n := range names {
		if re.MatchString(filepath.Base(n)) && n > best {
			best = n
		}
	}
	if best == "" {
		return "", fmt.Errorf("bench: no results/<date>.json to write the report from; run go run . -full first")
	}
	return best, nil
}

// readUpstream returns the newest results/<date>-upstream.json and its
// path, or nil.
func readUpstream() (*upstreamRun, string) {
	var run upstreamRun
	path := readNewest("*-upstream.json", &run)
	if path == "" {
		return nil, ""
	}
	return &run, path
}

// readNewest decodes into v the newest file of results/ matching pattern
// (dated names sort by date), and returns its path; "" if there is none or
// it does not decode.
func readNewest(pattern string, v any) string {
	names, _ := filepath.Glob(filepath.Join("results", pattern))
	if len(names) == 0 {
		return ""
	}
	slices.Sort(names)
	path := names[len(names)-1]
	b, err := os.ReadFile(path)
	if err != nil || json.Unmarshal(b, v) != nil {
		return ""
	}
	return path
}

// renderUpstream is the report's section for the upstream part.
func renderUpstream(run *upstreamRun, rel string) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c := run.Config
	var ls []string
	for _, ph := range c.Phases {
		ls = append(ls, fmt.Sprintf("%d/s for %gs", ph.L, ph.DurationS))
	}
	p("\n## Limits learned from the upstream\n\n")
	p("From [%s](%s); command `%s`, %s, library at %s.\n\n", rel, rel, run.Command, run.Date, run.Library.Commit)
	p("A fake API on loopback accepts L requests in each whole second and answers 429 with `Retry-After` beyond; L is %s, "+
		"unknown to the fleet, whose configured limit is %d/s (GCRA, burst 1). The fleet: %d `httpthrottle.Transport`s, each with its own Redis client "+
		"and Limiter on one redis-server, %d goroutines each sending as fast as allowed; the API answers in %gms. "+
		"With headers, every answer carries `RateLimit-Policy: \"default\";q=L;w=1` and `RateLimit: \"default\";r=<remaining>;t=<seconds to reset>`. "+
		"Steady figures leave out the first %gs of each phase; *reached* is when a sliding 1 s window (in %d ms bins) first held %.0f %% of the new L.\n\n",
		strings.Join(ls, ", then "), c.Configured, c.Workers, c.Goroutines, c.LatencyMS, c.SettleS, c.BinMS, c.ReachWithin*100)
	p("| scenario | requests | 429s | per phase: L → accepted/s in steady state (share of L), 429s, reached after |\n|---|---|---|---|\n")
	for _, s := range run.Scenarios {
		var phases []string
		for _, ph := range s.Phases {
			reach := "never"
			if ph.ReachS >= 0 {
				reach = fmt.Sprintf("%.1fs", ph.ReachS)
			}
			phases = append(phases, fmt.Sprintf("L=%d → %.1f/s (%.1f %%), %d × 429, %s", ph.L, ph.SteadyShare*float64(ph.L), ph.SteadyShare*100, ph.TooMany, reach))
		}
		p("| %s | %d | %d (%.2f %%) | %s |\n", s.Name, s.Requests, s.TooMany, 100*float64(s.TooMany)/float64(max(s.Requests, 1)), strings.Join(phases, "; "))
	}
	if len(run.Scenarios) > 0 {
		s := run.Scenarios[0]
		worstShare, worstReach := math.Inf(1), 0.0
		for _, ph := range s.Phases {
			worstShare = min(worstShare, ph.SteadyShare)
			if ph.ReachS < 0 {
				worstReach = math.Inf(1)
			} else {
				worstReach = max(worstReach, ph.ReachS)
			}
		}
		rate := float64(s.TooMany) / float64(max(s.Requests, 1))
		verdict := func(ok bool) string {
			if ok {
				return "met"
			}
			return "not met"
		}
		p("\nTargets for the learned limit: steady throughput ≥ 90 %% of L — **%s** (worst phase %.1f %%); fewer than 0.5 %% of requests answered 429 — **%s** (%.2f %%); "+
			"a new L reached within 2 s of the change — **%s** (slowest %.1fs).\n",
			verdict(worstShare >= 0.9), worstShare*100, verdict(rate < 0.005), rate*100, verdict(worstReach <= 2), worstReach)
	}
	return b.String()
}
