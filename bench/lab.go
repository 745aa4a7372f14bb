package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The jitter lab tests the cause this benchmark found for jobthrottle's
// Wait jitter under load (see notes.md): the bucket Wait as it is, the same
// reservation woken from its send time, a prototype GCRA reservation woken
// on Redis's clock (labImpls), and x/time/rate, at one scenario, on a quiet
// machine and beside busy processes of its own, rounds interleaved.

// labResult is the jitter lab's JSON: results/<date>-jitterlab.json.
type labResult struct {
	partHead
	Config   labConfig   `json:"config"`
	RuntimeS float64     `json:"runtime_s"`
	Runs     []labRun    `json:"runs"`
	Summary  []labSummry `json:"summary"`
	Errors   []string    `json:"errors,omitempty"`
}

type labConfig struct {
	Rate      int      `json:"rate"`
	Burst     int      `json:"burst"`
	Waiters   int      `json:"waiters"`
	Procs     int      `json:"procs"`
	DurationS float64  `json:"duration_s"`
	Rounds    int      `json:"rounds"`
	Burners   int      `json:"burners"` // spinning goroutines in the loaded condition, one process
	Impls     []string `json:"impls"`
	Nice      int      `json:"nice"`
}

type labRun struct {
	Condition string          `json:"condition"` // quiet or loaded
	Round     int             `json:"round"`
	Result    *scenarioResult `json:"result"`
}

// labSummry is one implementation under one condition, over the rounds.
type labSummry struct {
	Condition      string  `json:"condition"`
	Impl           string  `json:"impl"`
	JitterP99us    float64 `json:"jitter_p99_us_median"`
	JitterP50us    float64 `json:"jitter_p50_us_median"`
	JitterP99Range string  `json:"jitter_p99_us_rounds"`
	WaitP99ms      float64 `json:"wait_p99_ms_median"`
	Max1s          int     `json:"max_1s_worst"`
	Bound1s        int     `json:"bound_1s"`
	AccuracyMin    float64 `json:"accuracy_min"`
	CanaryP99us    float64 `json:"canary_p99_us_median"`
}

func runLab(logf func(string, ...any), rounds int, d time.Duration) error {
	t0 := time.Now()
	names := []string{"jobthrottle/gcra", labImpls[0].Name, labImpls[1].Name, "x/time/rate"}
	cfg := labConfig{Rate: 200, Burst: 10, Waiters: 64, Procs: 1, DurationS: d.Seconds(), Rounds: rounds, Burners: 2, Impls: names, Nice: niceness}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	res := &labResult{partHead: head, Config: cfg}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	if err := warmScripts(ctx, rdb); err != nil {
		return err
	}
	if err := gcraNow.Load(ctx, rdb).Err(); err != nil {
		return err
	}
	r := &runner{exe: exe, srv: srv, rdb: rdb, logf: logf}
	for round := 1; round <= rounds; round++ {
		for _, cond := range []string{"quiet", "loaded"} {
			for _, name := range names {
				im, err := implByName(name)
				if err != nil {
					return err
				}
				s := scenario{Impl: im, Rate: cfg.Rate, Burst: cfg.Burst, Waiters: cfg.Waiters, Procs: cfg.Procs, Duration: d}
				if cond == "loaded" {
					s.Burners = cfg.Burners
				}
				sr, err := r.runScenario(ctx, s)
				if err != nil {
					res.Errors = append(res.Errors, fmt.Sprintf("%s %v: %v", cond, s, err))
					logf("%s %v: %v", cond, s, err)
					continue
				}
				logf("round %d %-6s %-44s jitter p50 %4.0fµs p99 %5.0fµs  wait p99 %6.1fms  max1s %d/%d  %.2f%%  canary p99 %.0fµs",
					round, cond, name, sr.JitterP50us, sr.JitterP99us, sr.WaitP99ms, sr.Max1s, sr.Bound1s, sr.Accuracy*100, sr.TimerLateP99us)
				res.Runs = append(res.Runs, labRun{Condition: cond, Round: round, Result: sr})
			}
		}
	}
	for _, cond := range []string{"quiet", "loaded"} {
		for _, name := range names {
			var p99, p50, wait, canary []float64
			sum := labSummry{Condition: cond, Impl: name, AccuracyMin: 1e9}
			for _, run := range res.Runs {
				s := run.Result
				if run.Condition != cond || s.Impl != name {
					continue
				}
				p99, p50 = append(p99, s.JitterP99us), append(p50, s.JitterP50us)
				wait, canary = append(wait, s.WaitP99ms), append(canary, s.TimerLateP99us)
				sum.Max1s, sum.Bound1s = max(sum.Max1s, s.Max1s), s.Bound1s
				sum.AccuracyMin = min(sum.AccuracyMin, s.Accuracy)
			}
			if len(p99) == 0 {
				continue
			}
			var rs []string
			for _, v := range p99 {
				rs = append(rs, fmt.Sprintf("%.0f", v))
			}
			sum.JitterP99Range = strings.Join(rs, ", ")
			sum.JitterP99us, sum.JitterP50us, sum.WaitP99ms, sum.CanaryP99us = medianF(p99), medianF(p50), medianF(wait), medianF(canary)
			res.Summary = append(res.Summary, sum)
			logf("%-6s %-44s jitter p99 median %5.0fµs (%s)  p50 %4.0fµs  wait p99 %6.1fms  max1s %d/%d", cond, name, sum.JitterP99us, sum.JitterP99Range, sum.JitterP50us, sum.WaitP99ms, sum.Max1s, sum.Bound1s)
		}
	}
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, "jitterlab", res)
}

func medianF(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

// readLab reads the jitter lab's results beside a run's, or else the
// newest in its directory (a run of some parts only has none of its own),
// and names the file it read.
func readLab(jsonPath string) (*labResult, string) {
	path := resultBeside(jsonPath, "-jitterlab.json")
	if path == "" {
		return nil, ""
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, ""
	}
	var lab labResult
	if json.Unmarshal(b, &lab) != nil {
		return nil, ""
	}
	return &lab, path
}
