package main

import (
	"fmt"
	"math"
	"strings"
)

// target is one goal of issue 4, checked against a run.
type target struct {
	ID       string   `json:"id"`
	Goal     string   `json:"goal"`
	Checks   int      `json:"checks"` // scenarios it was checked on
	Met      bool     `json:"met"`
	Worst    string   `json:"worst"`    // the worst case, with its value and bound
	Failures []string `json:"failures"` // every case that missed, with by how much
}

var bucketImpls = []string{"jobthrottle/token_bucket", "jobthrottle/gcra"}
var windowImpls = []string{"jobthrottle/fixed_window", "jobthrottle/sliding_log", "jobthrottle/sliding_window"}

func where(s *scenarioResult) string {
	b := fmt.Sprintf("b=%d ", s.Burst)
	if !s.BurstApplies {
		b = ""
	}
	return fmt.Sprintf("%s %sW=%d P=%d", s.Impl, b, s.Waiters, s.Procs)
}

// check folds per-case results into a target: value is the figure, ok
// whether it met the goal, slack how far inside (>0) or outside (<0) the
// bound it is, in the figure's units, for picking the worst case.
type check struct {
	t         target
	worstSeen float64
	any       bool
}

func (c *check) add(s *scenarioResult, ok bool, slack float64, desc string) {
	c.t.Checks++
	if !ok {
		if s.TimerLateMaxms > 0 {
			desc += fmt.Sprintf("; canary p99 %.0f µs, max %.1f ms", s.TimerLateP99us, s.TimerLateMaxms)
		}
		c.t.Failures = append(c.t.Failures, where(s)+": "+desc)
	}
	if !c.any || slack < c.worstSeen {
		c.worstSeen, c.any = slack, true
		c.t.Worst = where(s) + ": " + desc
	}
}

func (c *check) done() target {
	c.t.Met = c.t.Checks > 0 && len(c.t.Failures) == 0
	if c.t.Checks == 0 {
		c.t.Worst = "not measured in this run"
	}
	return c.t
}

func in(name string, names []string) bool {
	for _, n := range names {
		if n == name {
			return true
		}
	}
	return false
}

// evaluate checks every target against the run.
func evaluate(res *runResult) []target {
	var out []target
	find := func(impl string, burst, w, p int) *scenarioResult {
		for _, s := range res.Scenarios {
			if s.Impl == impl && s.Burst == burst && s.Waiters == w && s.Procs == p {
				return s
			}
		}
		return nil
	}
	buckets := func(f func(s *scenarioResult)) {
		for _, s := range res.Scenarios {
			if in(s.Impl, bucketImpls) {
				f(s)
			}
		}
	}

	c := &check{t: target{ID: "rt", Goal: "token bucket and GCRA Wait: Redis round trips per admitted permit ≤ 1.05 at every W and P"}}
	buckets(func(s *scenarioResult) {
		c.add(s, s.RTPerPermit <= 1.05, 1.05-s.RTPerPermit, fmt.Sprintf("%.3f (bound 1.05: %s)", s.RTPerPermit, margin(s.RTPerPermit, 1.05, "%.3f")))
	})
	out = append(out, c.done())

	c = &check{t: target{ID: "accuracy", Goal: "token bucket and GCRA Wait: steady admitted rate 99.5–100.5 % of R"}}
	buckets(func(s *scenarioResult) {
		a := s.Accuracy * 100
		slack := math.Min(a-99.5, 100.5-a)
		c.add(s, slack >= 0, slack, fmt.Sprintf("%.2f %% of R (%.2f points inside 99.5–100.5)", a, slack))
	})
	out = append(out, c.done())

	c = &check{t: target{ID: "limit", Goal: "token bucket and GCRA Wait: never more than R + burst (+2) in any 1 s window"}}
	buckets(func(s *scenarioResult) {
		bound := s.Bound1s + 2
		c.add(s, s.Max1s <= bound, float64(bound-s.Max1s), fmt.Sprintf("%d in 1 s (R + burst = %d: %s; %d in 990 ms)", s.Max1s, s.Bound1s, margin(float64(s.Max1s), float64(s.Bound1s), "%.0f"), s.Max990ms))
	})
	out = append(out, c.done())

	c = &check{t: target{ID: "fairness", Goal: "token bucket and GCRA Wait: Jain's index ≥ 0.995 at W=256"}}
	buckets(func(s *scenarioResult) {
		if s.Waiters == 256 {
			c.add(s, s.Jain >= 0.995, s.Jain-0.995, fmt.Sprintf("%.4f (bound 0.995; permits per waiter %d–%d)", s.Jain, s.FairMin, s.FairMax))
		}
	})
	out = append(out, c.done())

	for _, fig := range []struct {
		id, name string
		get      func(*scenarioResult) float64
		unit     string
	}{
		{"jitter", "inter-admission jitter p99", func(s *scenarioResult) float64 { return s.JitterP99us }, "µs"},
		{"waitp99", "Wait p99", func(s *scenarioResult) float64 { return s.WaitP99ms }, "ms"},
	} {
		c = &check{t: target{ID: fig.id, Goal: "token bucket and GCRA Wait, P=1: " + fig.name + " within 1.2× of x/time/rate's"}}
		buckets(func(s *scenarioResult) {
			if s.Procs != 1 {
				return
			}
			ref := find("x/time/rate", s.Burst, s.Waiters, 1)
			if ref == nil {
				return
			}
			v, r := fig.get(s), fig.get(ref)
			ratio := math.Inf(1)
			if r > 0 {
				ratio = v / r
			}
			c.add(s, ratio <= 1.2, 1.2-ratio, fmt.Sprintf("%.1f %s vs %.1f %s = %.2f× (bound 1.2×: %s)", v, fig.unit, r, fig.unit, ratio, margin(ratio, 1.2, "%.2f×")))
		})
		out = append(out, c.done())
	}

	c = &check{t: target{ID: "redis_cpu", Goal: "token bucket and GCRA Wait: redis-server CPU per 1000 permits lower than every Redis-backed peer's"}}
	buckets(func(s *scenarioResult) {
		for _, peer := range res.Scenarios {
			if peer.Impl == "redis_rate" && peer.Burst == s.Burst && peer.Waiters == s.Waiters && peer.Procs == s.Procs {
				ratio := s.RedisCPUms / peer.RedisCPUms
				c.add(s, s.RedisCPUms < peer.RedisCPUms, 1-ratio, fmt.Sprintf("%.1f ms vs %s %.1f ms = %.2f× (bound: below 1×)", s.RedisCPUms, peer.Impl, peer.RedisCPUms, ratio))
			}
		}
	})
	out = append(out, c.done())

	c = &check{t: target{ID: "window_rt", Goal: "window algorithms Wait: round trips per permit ≤ 1.3 at W=256, P=4"}}
	for _, s := range res.Scenarios {
		if in(s.Impl, windowImpls) && s.Waiters == 256 && s.Procs == 4 {
			c.add(s, s.RTPerPermit <= 1.3, 1.3-s.RTPerPermit, fmt.Sprintf("%.3f (bound 1.3: %s)", s.RTPerPermit, margin(s.RTPerPermit, 1.3, "%.3f")))
		}
	}
	out = append(out, c.done())

	// On Redis's clock, which the scripts decide on, the windows' limits
	// are exact: a sliding log or sliding window (period 1 s, precision
	// 50 ms here) never holds more than R in any 1 s, a fixed window never
	// more than R in one whole second. The client's clock adds each
	// reply's return latency, hence the +2 when only it was measured.
	c = &check{t: target{ID: "window_limit", Goal: "window algorithms Wait: never over the limit (sliding log and sliding window: ≤ R in any 1 s window; fixed window: ≤ R in any whole second; on Redis's clock, or, in runs without it, + 2 on the client's)"}}
	for _, s := range res.Scenarios {
		if !in(s.Impl, windowImpls) {
			continue
		}
		fixed := s.Impl == "jobthrottle/fixed_window"
		v, bound, what := s.Max1s, s.Rate+2, fmt.Sprintf("in any 1 s on the client's clock, %d in any 990 ms", s.Max990ms)
		if fixed {
			v, what = s.MaxAligned1s, "in a whole wall-clock second"
		}
		if s.RedisClock {
			v, bound, what = s.Max1sRedis, s.Rate, fmt.Sprintf("in any 1 s on Redis's clock; %d on the client's", s.Max1s)
			if fixed {
				v, what = s.MaxAligned1sRedis, fmt.Sprintf("in a whole second on Redis's clock; %d in a wall-clock second", s.MaxAligned1s)
			}
		}
		c.add(s, v <= bound, float64(bound-v), fmt.Sprintf("%d (R = %d: %s) %s", v, s.Rate, margin(float64(v), float64(s.Rate), "%.0f"), what))
	}
	out = append(out, c.done())

	c = &check{t: target{ID: "throughput", Goal: "Allow throughput (50 goroutines, 10k keys) ≥ redis_rate's"}}
	var peer *throughputResult
	for _, t := range res.Throughput {
		if t.Impl == "redis_rate" {
			peer = t
		}
	}
	if peer != nil {
		for _, t := range res.Throughput {
			if in(t.Impl, bucketImpls) {
				ratio := t.OpsPerSec / peer.OpsPerSec
				c.t.Checks++
				desc := fmt.Sprintf("%s: %.0f/s vs redis_rate %.0f/s = %.3f×", t.Impl, t.OpsPerSec, peer.OpsPerSec, ratio)
				if ratio < 1 {
					c.t.Failures = append(c.t.Failures, desc)
				}
				if !c.any || ratio-1 < c.worstSeen {
					c.worstSeen, c.any = ratio-1, true
					c.t.Worst = desc
				}
			}
		}
	}
	out = append(out, c.done())
	return append(out, issue14Targets(res)...)
}

// issue14Targets are issue 14's gaps: each script call at most 0.9× the
// redis-server instructions of redis_rate's; unbatched Allow throughput
// at least 1.1× redis_rate's; a bucket key no larger than redis_rate's.
// Each is judged against redis_rate measured in the same run.
func issue14Targets(res *runResult) []target {
	bucket := func(impl string) bool { return in(impl, bucketImpls) }
	unbatched := func(impl string) bool { return strings.HasSuffix(impl, " (unbatched)") }
	return []target{
		vsRedisRate(target{ID: "servercost", Goal: "token bucket and GCRA: redis-server instructions per Allow ≤ 0.9× redis_rate's (callgrind)"},
			res.ServerCost, func(r *serverCostResult) (string, float64) { return r.Impl, r.IrPerCall }, bucket, 0.9, false),
		vsRedisRate(target{ID: "throughput-unbatched", Goal: "Allow throughput without batching (Options.NoBatching, 50 goroutines, 10k keys) ≥ 1.1× redis_rate's"},
			res.Throughput, func(t *throughputResult) (string, float64) { return t.Impl, t.OpsPerSec }, unbatched, 1.1, true),
		vsRedisRate(target{ID: "memory", Goal: "token bucket and GCRA: bytes per key (used_memory over 100 000 keys) ≤ redis_rate's"},
			res.Memory, func(m memoryResult) (string, float64) { return m.Impl, m.BytesPerKey }, bucket, 1, false),
	}
}

// vsRedisRate judges t on rows: each row whose implementation judged
// picks is held against redis_rate's row of the same run, its figure
// over redis_rate's at most bound (at least, if more).
func vsRedisRate[R any](t target, rows []R, figure func(R) (string, float64), judged func(string) bool, bound float64, more bool) target {
	var peer float64
	for _, r := range rows {
		if impl, v := figure(r); impl == "redis_rate" {
			peer = v
		}
	}
	c := &check{t: t}
	for _, row := range rows {
		impl, v := figure(row)
		if peer <= 0 || !judged(impl) {
			continue
		}
		r := v / peer
		c.t.Checks++
		desc := fmt.Sprintf("%s: %.0f vs redis_rate %.0f = %.3f× (bound %.2f×)", impl, v, peer, r, bound)
		ok, slack := r <= bound, bound-r
		if more {
			ok, slack = r >= bound, r-bound
		}
		if !ok {
			c.t.Failures = append(c.t.Failures, desc)
		}
		if !c.any || slack < c.worstSeen {
			c.worstSeen, c.any = slack, true
			c.t.Worst = desc
		}
	}
	return c.done()
}

// margin says how far v is under (or over) bound, for a figure where
// lower is better.
func margin(v, bound float64, format string) string {
	if v <= bound {
		return fmt.Sprintf(format+" under", bound-v)
	}
	return fmt.Sprintf(format+" over", v-bound)
}

// verdict is a target's short status for the table.
func (t target) verdict() string {
	switch {
	case t.Checks == 0:
		return "not measured"
	case t.Met:
		return "met"
	default:
		return fmt.Sprintf("missed (%d of %d)", len(t.Failures), t.Checks)
	}
}

func (t target) failureList() string { return strings.Join(t.Failures, "; ") }
