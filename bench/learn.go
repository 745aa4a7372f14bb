package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The learn part (-learn) measures, at the upstream, what issue 19 asks
// of httpthrottle: a fleet of Transports (each with its own Redis client,
// as separate processes have) sends a backlog of tasks to a fake API whose
// limit it is not told (learnapi.go: L/s, burst 1, 429 with Retry-After
// past it), in each header style the API may answer in, with and without
// a Redis stall (CLIENT PAUSE) half way through. Every figure is taken
// from the API's own log of arrivals.

// learnConfig is the part's setup.
type learnConfig struct {
	Limit      int      `json:"limit"`      // the API's L, requests per second, burst 1
	Configured int      `json:"configured"` // the fleet's rule: GCRA, this many per second, burst 1
	Tasks      int      `json:"tasks"`      // each sent until the API accepts it
	Workers    []int    `json:"workers"`    // Transports, each with its own Redis client and Limiter
	Goroutines int      `json:"goroutines"` // sending through each Transport
	Styles     []string `json:"styles"`     // rule-only: no limit at the API, the fleet's rule at Limit
	StallMS    int      `json:"stall_ms"`   // CLIENT PAUSE once half the tasks are done
	// Targets: the share of L after convergence (with headers, and
	// without), the share of requests answered 429 after it, and the
	// convergence time.
	ShareTarget       float64 `json:"share_target"`
	ShareTargetBare   float64 `json:"share_target_headerless"`
	TooManyTarget     float64 `json:"too_many_target"`
	TooManyTargetBare float64 `json:"too_many_target_headerless"`
	ConvergeTargetS   float64 `json:"converge_target_s"`
	CapFactor         float64 `json:"cap_factor"` // a run stops after CapFactor × Tasks / L + 20 s
	Nice              int     `json:"nice"`
}

func defaultLearnConfig() learnConfig {
	return learnConfig{Limit: 20, Configured: 100, Tasks: 1500, Workers: []int{3, 10}, Goroutines: 4,
		Styles:  []string{styleIETF, styleXSeconds, styleXUnix, styleRetryAfter, styleRuleOnly},
		StallMS: 4000, ShareTarget: 0.95, ShareTargetBare: 0.85, TooManyTarget: 0.002, TooManyTargetBare: 0.02,
		ConvergeTargetS: 1, CapFactor: 3}
}

// learnResult is the part's JSON: results/<date>-learn.json.
type learnResult struct {
	partHead
	Config   learnConfig `json:"config"`
	RuntimeS float64     `json:"runtime_s"`
	Runs     []*learnRun `json:"runs"`
}

// learnCase is one scenario of the part.
type learnCase struct {
	Style   string `json:"style"`
	Workers int    `json:"workers"`
	Stall   bool   `json:"stall"`
}

func (c learnCase) String() string {
	s := fmt.Sprintf("%s, %d workers", c.Style, c.Workers)
	if c.Stall {
		s += ", stall"
	}
	return s
}

// runLearnPart runs every case on one throwaway redis-server and writes
// results/<date>-<name>.json; only, if set, picks the cases whose name
// matches.
func runLearnPart(logf func(string, ...any), cfg learnConfig, only, name string) error {
	t0 := time.Now()
	var filter *regexp.Regexp
	if only != "" {
		var err error
		if filter, err = regexp.Compile(only); err != nil {
			return err
		}
	}
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	cfg.Nice = niceness
	res := &learnResult{partHead: head, Config: cfg}
	for _, c := range learnCases(cfg, filter) {
		logf("learn: %s", c)
		r, err := runLearnCase(srv.Addr, cfg, c, fmt.Sprintf("bench-learn-%d-%d:", t0.UnixNano(), len(res.Runs)))
		if err != nil {
			return err
		}
		logf("learn: %s", r.summary())
		res.Runs = append(res.Runs, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	if err := writePart(logf, t0, name, res); err != nil {
		return err
	}
	fmt.Print(renderLearn(res))
	return nil
}

// learnCases are the part's cases in order (style, then workers, then
// without and with a stall), those filter (if not nil) matches.
func learnCases(cfg learnConfig, filter *regexp.Regexp) []learnCase {
	var cs []learnCase
	for _, style := range cfg.Styles {
		for _, w := range cfg.Workers {
			for _, stall := range []bool{false, true} {
				c := learnCase{Style: style, Workers: w, Stall: stall}
				if filter == nil || filter.MatchString(c.String()) {
					cs = append(cs, c)
				}
			}
		}
	}
	return cs
}

// learnFleet is one case's Transports and what they count.
type learnFleet struct {
	clients   []*http.Client
	trs       []*httpthrottle.Transport
	rdbs      []*redis.Client
	scripts   atomic.Int64 // EVALSHA/EVAL on the fleet's clients
	redisErrs atomic.Int64 // commands that failed (timeouts included)
	mu        sync.Mutex
	errs      map[string]int // transport errors, by message (sampled)
}

func newLearnFleet(addr, prefix string, cfg learnConfig, style string, workers int) (*learnFleet, error) {
	f := &learnFleet{errs: map[string]int{}}
	rate := cfg.Configured
	if style == styleRuleOnly {
		rate = cfg.Limit
	}
	rule := throttle.Rule{Name: "partner", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate).WithBurst(1)}
	for range workers {
		rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: cfg.Goroutines + 4})
		rdb.AddHook(scriptCount{n: &f.scripts})
		rdb.AddHook(errorCount{n: &f.redisErrs})
		f.rdbs = append(f.rdbs, rdb)
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rule)
		if err != nil {
			f.close()
			return nil, err
		}
		tr, err := httpthrottle.New(lim, httpthrottle.Options{Base: &http.Transport{MaxIdleConnsPerHost: cfg.Goroutines * 2}})
		if err != nil {
			f.close()
			return nil, err
		}
		f.trs = append(f.trs, tr)
		f.clients = append(f.clients, &http.Client{Transport: tr})
	}
	return f, nil
}

func (f *learnFleet) close() {
	for _, r := range f.rdbs {
		_ = r.Close()
	}
}

// noteErr records a transport error, by its message without numbers.
func (f *learnFleet) noteErr(err error) {
	msg := regexp.MustCompile(`[0-9.]+(ms|s|µs)?`).ReplaceAllString(err.Error(), "#")
	f.mu.Lock()
	f.errs[msg]++
	f.mu.Unlock()
}

// runLearnCase sends cfg.Tasks tasks through a fresh fleet to a fresh API,
// each until accepted, and analyses the API's log.
func runLearnCase(addr string, cfg learnConfig, c learnCase, prefix string) (*learnRun, error) {
	api := newLimitedAPI(cfg.Limit, c.Style)
	hs := httptest.NewServer(api)
	defer hs.Close()
	f, err := newLearnFleet(addr, prefix, cfg, c.Style, c.Workers)
	if err != nil {
		return nil, err
	}
	defer f.close()
	capD := time.Duration(cfg.CapFactor*float64(cfg.Tasks)/float64(cfg.Limit)*float64(time.Second)) + 20*time.Second
	ctx, cancel := context.WithTimeout(context.Background(), capD)
	defer cancel()
	var next, done atomic.Int64
	stallAt := time.Duration(-1)
	var wg sync.WaitGroup
	if c.Stall {
		wg.Go(func() { stallAt = stallHalfWay(ctx, addr, api, done.Load, cfg) })
	}
	start := time.Now()
	for _, cl := range f.clients {
		for range cfg.Goroutines {
			wg.Go(func() {
				for next.Add(1) <= int64(cfg.Tasks) && ctx.Err() == nil {
					if sendUntilAccepted(ctx, cl, hs.URL+"/v1/task", f) {
						done.Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	r := analyseLearn(api.log(), cfg, c, stallAt)
	r.Done, r.TookS = int(done.Load()), time.Since(start).Seconds()
	r.ScriptsPerRequest = float64(f.scripts.Load()) / float64(max(r.Requests, 1))
	r.RedisErrors = f.redisErrs.Load()
	r.TransportErrors = f.errs
	r.learnStats = collectStats(f.trs)
	return r, nil
}

// sendUntilAccepted sends one task until the API accepts it (a 429 is
// sent again: the transport has paused and slowed down), or ctx ends.
func sendUntilAccepted(ctx context.Context, cl *http.Client, url string, f *learnFleet) bool {
	for ctx.Err() == nil {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, nil)
		resp, err := cl.Do(req)
		if err != nil {
			if ctx.Err() == nil {
				f.noteErr(err)
				time.Sleep(10 * time.Millisecond)
			}
			continue
		}
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return true
		}
	}
	return false
}

// stallHalfWay pauses every Redis client for cfg.StallMS once half the
// tasks are done (done counts them), and returns when (since the API's
// start) it did; -1 if it never did.
func stallHalfWay(ctx context.Context, addr string, api *limitedAPI, done func() int64, cfg learnConfig) time.Duration {
	admin := redis.NewClient(&redis.Options{Addr: addr})
	defer admin.Close()
	for done() < int64(cfg.Tasks/2) {
		if ctx.Err() != nil {
			return -1
		}
		time.Sleep(5 * time.Millisecond)
	}
	at := time.Since(api.start)
	if err := admin.Do(ctx, "CLIENT", "PAUSE", cfg.StallMS).Err(); err != nil {
		return -1
	}
	return at
}

// errorCount counts a client's failed commands (a redis.Nil answer is
// not a failure). go-redis's connection handshake asks for CLIENT
// MAINT_NOTIFICATIONS, which Redis 7.0 does not know: that one error per
// client, which go-redis ignores, is not counted either (it was the
// redis_errors = number of workers of the runs before 2026-11-26).
type errorCount struct{ n *atomic.Int64 }

func (errorCount) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c errorCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err != nil && !errors.Is(err, redis.Nil) && !strings.HasPrefix(err.Error(), "NOSCRIPT") && cmd.Name() != "client" {
			c.n.Add(1)
		}
		return err
	}
}

func (c errorCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// learnStats are the fleet's Transports' own counts (httpthrottle.Stats),
// summed: how many times a 429 lowered the learned rate, the pauses
// recorded, the departures booked again, and the requests that left later
// than the departure tolerance.
type learnStats struct {
	Lowered  int64 `json:"lowered"`
	Paused   int64 `json:"paused"`
	Rebooked int64 `json:"rebooked"`
	LeftLate int64 `json:"left_late"`
}

func collectStats(trs []*httpthrottle.Transport) learnStats {
	var s learnStats
	for _, tr := range trs {
		st := tr.Stats()
		s.Lowered += st.Lowered
		s.Paused += st.Paused
		s.Rebooked += st.Rebooked
		s.LeftLate += st.LeftLate
	}
	return s
}
