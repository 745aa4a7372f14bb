package main

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// learnRun is one case's figures, all taken at the API.
type learnRun struct {
	learnCase
	Done     int     `json:"done"` // tasks accepted
	TookS    float64 `json:"took_s"`
	Requests int     `json:"requests"`
	TooMany  int     `json:"too_many"`
	// ConvergedS is from the first request to the start of the first 1 s
	// window holding at least ShareGoal × L accepted requests and no 429;
	// -1 if none did.
	ConvergedS float64 `json:"converged_s"`
	ShareGoal  float64 `json:"share_goal"`
	// After convergence: requests and 429s, accepted requests as a share
	// of L over the time to the last request (less the stall), and the
	// share of requests answered 429.
	AfterRequests int     `json:"after_requests"`
	AfterTooMany  int     `json:"after_too_many"`
	ShareAfter    float64 `json:"share_after"`
	TooManyAfter  float64 `json:"too_many_after"`
	// The most requests (accepted or not) in any 1 s at the API, and the
	// bound L + burst; Max1sStall is the most in a 1 s window starting
	// from 1 s before the stall's end to 2 s after it (-1 without a stall).
	Max1s      int     `json:"max_1s"`
	Bound1s    int     `json:"bound_1s"`
	Max1sStall int     `json:"max_1s_stall"`
	StallAtS   float64 `json:"stall_at_s"` // since the API started; -1 without
	// The closest two requests came at the API, how many pairs came
	// closer than half the API's interval, and closer than the interval
	// (each such pair is a 429).
	MinGapMS      float64 `json:"min_gap_ms"`
	CloseGaps     int     `json:"close_gaps"`
	UnderInterval int     `json:"under_interval"`
	// ScriptsPerRequest is the fleet's EVALSHA/EVAL calls per request
	// sent; RedisErrors its failed Redis commands (timeouts included).
	ScriptsPerRequest float64        `json:"scripts_per_request"`
	RedisErrors       int64          `json:"redis_errors"`
	TransportErrors   map[string]int `json:"transport_errors,omitempty"`
	// PerSecond is the accepted requests in each second from the first
	// request; TooManyAtS when each 429 came, from the first request.
	PerSecond  []int     `json:"per_second"`
	TooManyAtS []float64 `json:"too_many_at_s,omitempty"`
	learnStats
}

// analyseLearn computes a case's figures from the API's log.
func analyseLearn(hits []apiHit, cfg learnConfig, c learnCase, stallAt time.Duration) *learnRun {
	r := &learnRun{learnCase: c, ConvergedS: -1, Max1sStall: -1, StallAtS: -1, Bound1s: cfg.Limit + 1, ShareGoal: cfg.ShareTarget}
	if c.Style == styleRetryAfter {
		r.ShareGoal = cfg.ShareTargetBare
	}
	slices.SortFunc(hits, func(a, b apiHit) int { return int(a.at - b.at) })
	r.Requests = len(hits)
	if len(hits) == 0 {
		return r
	}
	at := make([]int64, len(hits))
	for i, h := range hits {
		at[i] = int64(h.at)
		if !h.ok {
			r.TooMany++
		}
	}
	r.Max1s = maxInWindow(at, int64(time.Second))
	for _, h := range hits {
		s := h.at - hits[0].at
		if !h.ok {
			r.TooManyAtS = append(r.TooManyAtS, s.Seconds())
			continue
		}
		for int(s/time.Second) >= len(r.PerSecond) {
			r.PerSecond = append(r.PerSecond, 0)
		}
		r.PerSecond[s/time.Second]++
	}
	stall := time.Duration(0)
	if stallAt >= 0 {
		r.StallAtS = stallAt.Seconds()
		stall = time.Duration(cfg.StallMS) * time.Millisecond
		end := stallAt + stall
		r.Max1sStall = maxStarting(at, int64(end-time.Second), int64(end+2*time.Second), int64(time.Second))
	}
	r.MinGapMS, r.CloseGaps = gaps(at, time.Second/time.Duration(cfg.Limit)/2)
	_, r.UnderInterval = gaps(at, time.Second/time.Duration(cfg.Limit))
	conv := converged(hits, int(math.Ceil(r.ShareGoal*float64(cfg.Limit))))
	if conv < 0 {
		return r
	}
	r.ConvergedS = (hits[conv].at - hits[0].at).Seconds()
	accepted := 0
	for _, h := range hits[conv:] {
		r.AfterRequests++
		if h.ok {
			accepted++
		} else {
			r.AfterTooMany++
		}
	}
	span := hits[len(hits)-1].at - hits[conv].at - stall
	if span > 0 {
		r.ShareAfter = float64(accepted) / (span.Seconds() * float64(cfg.Limit))
	}
	r.TooManyAfter = float64(r.AfterTooMany) / float64(r.AfterRequests)
	return r
}

// converged returns the index of the first request that starts a 1 s
// window holding at least goal accepted requests and no 429; -1 if none.
func converged(hits []apiHit, goal int) int {
	ok, refused, hi := 0, 0, 0
	for lo := range hits {
		for hi < len(hits) && hits[hi].at-hits[lo].at < time.Second {
			if hits[hi].ok {
				ok++
			} else {
				refused++
			}
			hi++
		}
		if ok >= goal && refused == 0 {
			return lo
		}
		if hits[lo].ok {
			ok--
		} else {
			refused--
		}
	}
	return -1
}

// maxStarting is the most timestamps in a window of w that starts at one
// of them, between from and to.
func maxStarting(sorted []int64, from, to, w int64) int {
	best, hi := 0, 0
	for lo, t := range sorted {
		if t < from || t > to {
			continue
		}
		hi = max(hi, lo)
		for hi < len(sorted) && sorted[hi]-t < w {
			hi++
		}
		best = max(best, hi-lo)
	}
	return best
}

// gaps returns the smallest gap between consecutive timestamps, in ms,
// and how many are under close.
func gaps(sorted []int64, close time.Duration) (float64, int) {
	least, n := math.Inf(1), 0
	for i := 1; i < len(sorted); i++ {
		g := time.Duration(sorted[i] - sorted[i-1])
		least = min(least, float64(g)/float64(time.Millisecond))
		if g < close {
			n++
		}
	}
	if math.IsInf(least, 1) {
		least = -1
	}
	return least, n
}

// summary is a run's figures on one line, for the log.
func (r *learnRun) summary() string {
	return fmt.Sprintf("%d/%d tasks in %.1fs, %d requests, %d × 429; converged %.2fs; after: %.1f %% of L, %.2f %% 429; max 1 s %d (bound %d), across the stall %d; min gap %.2f ms, %d close, %d under the interval; %.2f scripts/request, %d Redis errors, stats %+v, errors %v",
		r.Done, r.Requests-r.TooMany, r.TookS, r.Requests, r.TooMany, r.ConvergedS, 100*r.ShareAfter, 100*r.TooManyAfter,
		r.Max1s, r.Bound1s, r.Max1sStall, r.MinGapMS, r.CloseGaps, r.UnderInterval, r.ScriptsPerRequest, r.RedisErrors, r.learnStats, r.TransportErrors)
}

// renderLearn is the part's table, in markdown, for BENCHMARKS.md.
func renderLearn(res *learnResult) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c := res.Config
	p("| style | workers | stall | tasks done | requests | converged | share of L after | 429s after | max in 1 s (bound %d) | across the stall | min gap | lowered / paused | scripts/request |\n", c.Limit+1)
	p("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range res.Runs {
		stall, across := "—", "—"
		if r.Stall {
			stall = fmt.Sprintf("%.1f s", r.StallAtS)
			across = fmt.Sprint(r.Max1sStall)
		}
		conv := "never"
		if r.ConvergedS >= 0 {
			conv = fmt.Sprintf("%.2f s", r.ConvergedS)
		}
		p("| %s | %d | %s | %d of %d in %.1f s | %d (%d × 429) | %s | %.1f %% | %.2f %% (%d) | %d | %s | %.1f ms | %d / %d | %.2f |\n",
			r.Style, r.Workers, stall, r.Done, c.Tasks, r.TookS, r.Requests, r.TooMany, conv,
			100*r.ShareAfter, 100*r.TooManyAfter, r.AfterTooMany, r.Max1s, across, r.MinGapMS, r.Lowered, r.Paused, r.ScriptsPerRequest)
	}
	return b.String()
}
