package main

import (
	"cmp"
	"context"
	"encoding/csv"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"
)

// throughputResult is one Allow throughput measurement.
type throughputResult struct {
	Impl       string  `json:"impl"`
	Command    string  `json:"command,omitempty"` // for redis-benchmark: what ran
	Goroutines int     `json:"goroutines"`        // concurrent callers (connections for redis-benchmark)
	Keys       int     `json:"keys"`
	DurationS  float64 `json:"duration_s"`
	Ops        int64   `json:"ops"`
	OpsPerSec  float64 `json:"ops_per_sec"` // the median round's
	// RoundsOpsPerSec is every round's rate; the rounds of all
	// implementations are interleaved, so a noisy spell hits them alike.
	RoundsOpsPerSec []float64 `json:"rounds_ops_per_sec"`
	AllowedFrac     float64   `json:"allowed_frac"`
	RTPerOp         float64   `json:"rt_per_op"`
	CmdsPerOp       float64   `json:"cmds_per_op"`
	ScriptsOp       float64   `json:"scripts_per_op"`
	ClientCPUms     float64   `json:"client_cpu_ms_per_1000"`
	RedisCPUms      float64   `json:"redis_cpu_ms_per_1000"`
	Errors          int64     `json:"errors"`
}

// runThroughput measures Allow on random keys of a keyspace from many
// goroutines in one child process.
func (r *runner) runThroughput(ctx context.Context, implName string, goroutines, keys, rate, burst int, d time.Duration) (*throughputResult, error) {
	r.seq++
	w := workload{Mode: "allow", Impl: implName, Addr: r.srv.Addr, Rate: rate, Burst: burst,
		Waiters: goroutines, Keys: keys, Key: fmt.Sprintf("tp-%d-%d", time.Now().UnixNano(), r.seq),
		StartUnixNano: time.Now().Add(lead).UnixNano(), Duration: d}
	before, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	procs, err := r.spawn([]workload{w})
	if err != nil {
		return nil, err
	}
	after, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	p := procs[0]
	res := &throughputResult{Impl: implName, Goroutines: goroutines, Keys: keys,
		DurationS: float64(p.ElapsedNs) / 1e9, Ops: p.Ops, Errors: p.Errors}
	if p.Ops > 0 {
		total, scripts := callDelta(before, after)
		n := float64(p.Ops)
		res.OpsPerSec = n / res.DurationS
		res.AllowedFrac = float64(p.Allowed) / n
		res.RTPerOp = float64(p.RoundTrips) / n
		res.CmdsPerOp = float64(total) / n
		res.ScriptsOp = float64(scripts) / n
		res.ClientCPUms = ms(p.CPUNs) / n * 1000
		res.RedisCPUms = (after.CPU - before.CPU) * 1e6 / n
	}
	return res, nil
}

// runRedisBenchmark runs redis-benchmark's EVALSHA of a trivial script on
// the same server: the ceiling for one script call per operation.
func (r *runner) runRedisBenchmark(ctx context.Context, clients, requests int) (*throughputResult, error) {
	bin, err := exec.LookPath("redis-benchmark")
	if err != nil {
		return nil, fmt.Errorf("bench: redis-benchmark not found (Debian package redis-tools): %w", err)
	}
	sha, err := r.rdb.ScriptLoad(ctx, "return 1").Result()
	if err != nil {
		return nil, err
	}
	host, port, _ := strings.Cut(r.srv.Addr, ":")
	args := []string{"-h", host, "-p", port, "-c", strconv.Itoa(clients), "-n", strconv.Itoa(requests),
		"--csv", "evalsha", sha, "0"}
	before, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	out, err := exec.CommandContext(ctx, bin, args...).Output()
	elapsed := time.Since(t0)
	if err != nil {
		return nil, fmt.Errorf("bench: redis-benchmark: %w", err)
	}
	after, err := readStats(ctx, r.rdb)
	if err != nil {
		return nil, err
	}
	recs, err := csv.NewReader(strings.NewReader(string(out))).ReadAll()
	if err != nil || len(recs) < 2 || len(recs[1]) < 2 {
		return nil, fmt.Errorf("bench: redis-benchmark output %q: %v", out, err)
	}
	rps, err := strconv.ParseFloat(recs[1][1], 64)
	if err != nil {
		return nil, fmt.Errorf("bench: redis-benchmark rps %q: %w", recs[1][1], err)
	}
	total, scripts := callDelta(before, after)
	n := float64(requests)
	return &throughputResult{
		Impl:        "redis-benchmark EVALSHA 'return 1'",
		Command:     "redis-benchmark " + strings.Join(args, " "),
		Goroutines:  clients,
		DurationS:   elapsed.Seconds(),
		Ops:         int64(requests),
		OpsPerSec:   rps,
		AllowedFrac: 1,
		RTPerOp:     1,
		CmdsPerOp:   float64(total) / n,
		ScriptsOp:   float64(scripts) / n,
		RedisCPUms:  (after.CPU - before.CPU) * 1e6 / n,
	}, nil
}

// median returns the result of the median round by rate, with every
// round's rate attached.
func median(rounds []*throughputResult) *throughputResult {
	sorted := slices.Clone(rounds)
	slices.SortFunc(sorted, func(a, b *throughputResult) int { return cmp.Compare(a.OpsPerSec, b.OpsPerSec) })
	m := *sorted[len(sorted)/2]
	for _, r := range rounds {
		m.RoundsOpsPerSec = append(m.RoundsOpsPerSec, r.OpsPerSec)
	}
	return &m
}
