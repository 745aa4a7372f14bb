package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// fleetHeading starts the fleet part's section of BENCHMARKS.md; the
// section runs to the next "## " heading or the end.
const fleetHeading = "## A fleet of 1,000 workers, simulated (issue 25)"

// fleetTargets are issue 25's targets that the fleet part measures, the
// busy ones per case.
func fleetTargets(r *fleetResult) []target {
	check := func(id, goal string, met bool, worst string) target {
		t := target{ID: id, Goal: goal, Checks: 1, Met: met, Worst: worst}
		if !met {
			t.Failures = []string{worst}
		}
		return t
	}
	idle := r.Idle
	out := []target{check("idle", "idle: ≤ 1 Redis call per second per worker", idle.PerWorkerPerS <= 1,
		fmt.Sprintf("%.3f per worker per second (%d calls, %d workers, %.1f s)", idle.PerWorkerPerS, idle.Calls, r.Config.Workers, idle.DurationS))}
	for _, b := range r.Busy {
		out = append(out,
			check("looks/"+b.Rule, "busy: ≤ 0.2 ledger looks per parked task", b.LooksPer <= 0.2,
				fmt.Sprintf("%s: %.3f looks per parked task, %.3f of them took nothing", b.Rule, b.LooksPer, b.EmptyPer)),
			check("limiter/"+b.Rule, "busy: ≤ 2.05 limiter calls per parked task", b.PerParked <= 2.05,
				fmt.Sprintf("%s: %.3f per parked task (%.3f per task)", b.Rule, b.PerParked, b.PerTask)),
			check("writes/"+b.Rule, "busy: ≤ 1 ledger write per parked task", b.WritesPer <= 1, fmt.Sprintf("%s: %.3f per parked task", b.Rule, b.WritesPer)),
			check("once/"+b.Rule, "0 wake-ups lost or doubled", b.Lost == 0 && b.Doubled == 0,
				fmt.Sprintf("%s: %d tasks never started, %d started twice, of %d", b.Rule, b.Lost, b.Doubled, b.Tasks)))
	}
	return out
}

// writeFleetSection puts the fleet section into the report at mdPath, in
// place of the one there, or at its end.
func writeFleetSection(r *fleetResult, rel, mdPath string) error {
	old, err := os.ReadFile(mdPath)
	if err != nil {
		return err
	}
	return os.WriteFile(mdPath, []byte(replaceFleetSection(string(old), renderFleet(r, rel))), 0o644)
}

func replaceFleetSection(md, section string) string {
	start := strings.Index(md, fleetHeading)
	if start < 0 {
		return strings.TrimRight(md, "\n") + "\n\n" + section
	}
	end := len(md)
	if i := strings.Index(md[start+len(fleetHeading):], "\n## "); i >= 0 {
		end = start + len(fleetHeading) + i + 1
	}
	return md[:start] + section + md[end:]
}

// renderFleet is the report's section for the fleet part.
func renderFleet(r *fleetResult, rel string) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c, m := r.Config, r.Machine
	p("%s\n\n", fleetHeading)
	p("From [%s](%s): `%s`, %s (runtime %.0f s), library at %s; %d CPUs, %s, redis-server %s; load average %s at the start, %s at the end (the machine is shared with other sessions).\n\n",
		rel, rel, r.Command, r.Date, r.RuntimeS, r.Library.Commit, m.NProc, m.GoVersion, m.RedisVersion, m.LoadStart, m.LoadEnd)
	p("**What runs.** A 3-master Redis Cluster on loopback, started and stopped by the bench. %d simulated workers in %d OS processes (the bench re-executes itself), "+
		"each worker with its own go-redis `ClusterClient` (its own connections and its own subscription), its own `throttle.Limiter`, `admission.Gate`s and `admission.Parking`, "+
		"and its own wake-up loop (`Parking.Run`) on the %d-shard ledger, as a `cmd/worker` process has them; %d task slots per worker. Without asynq: asynq's own traffic "+
		"(each server polls its queues several times a second) would swamp two cores and is not what is measured; a queue in memory per process stands for it, and a task is named by its ID, "+
		"so a wake-up taken by any process brings it back there. Every limiter call is a real script call. Busy, each tenant's rule is GCRA one task per %v (burst 1, the default MaxWait "+
		"and WaitSlots), %d tasks per tenant enqueued together, %d tenants arriving evenly over %v, one case after the other: *booked*, whose Horizon covers a tenant's tasks, so "+
		"that a parked task books its turn at once (one wake-up each); *lined*, the default Horizon%s, where a turn more than a second ahead waits in the tenant's line "+
		"until a serving books it (%d tenants, arriving at the same rate). Memory: %d tenants of a rule of one task per %v each run one task, then park one on a booked turn, then one in line.\n\n",
		c.Workers, c.Procs, c.Shards, c.Concurrency, c.Interval, c.PerTenant, c.Tenants, c.Arrival, horizonNote(c), c.LinedTenants, c.MemTenants, holdInterval)
	renderFleetTable(p, r)
	renderFleetNodes(p, r)
	renderFleetExtrapolation(p, r)
	if notes, err := os.ReadFile("fleet-notes.md"); err == nil {
		p("\n%s", notes)
	}
	return b.String()
}

func horizonNote(c fleetConfig) string {
	if c.Horizon == 0 {
		return " (1s)"
	}
	return fmt.Sprintf(" (here %v)", c.Horizon)
}

func renderFleetTable(p func(string, ...any), r *fleetResult) {
	idle, mem := r.Idle, r.Memory
	verdict := map[string]string{}
	for _, t := range r.Targets {
		verdict[t.ID] = map[bool]string{true: "met", false: "**not met**"}[t.Met]
	}
	p("| idle (no task, %.0f s) | value | target |\n|---|---:|---|\n", idle.DurationS)
	p("| Redis calls per second per worker (clients' commands on the masters) | %.3f | ≤ 1: %s |\n", idle.PerWorkerPerS, verdict["idle"])
	p("| the same, total for the fleet | %.0f/s | |\n", float64(idle.Calls)/idle.DurationS)
	p("| by command, fleet per second | %s | |\n", perSecond(idle.Nodes, idle.DurationS))
	p("| hooked commands (looks) per worker per second, least / median / most active worker | %.2f / %.2f / %.2f | |\n", idle.WorkerMin, idle.WorkerMedian, idle.WorkerMax)
	if a := r.IdleAfter; a != nil {
		p("| idle again after the busy cases: Redis calls per second per worker | %.3f | ≤ 1: %s |\n", a.PerWorkerPerS, map[bool]string{true: "met", false: "**not met**"}[a.PerWorkerPerS <= 1])
		p("| the same, by command, fleet per second | %s | |\n", perSecond(a.Nodes, a.DurationS))
		p("| the same: limiter calls per second, by rule (servings of lines) | %s | |\n", perRule(a.Client.Limiter, a.DurationS))
	}
	p("| memory per parked task on a booked turn, MEMORY USAGE of the keys (%d tenants; of which the ledger entry) | %.0f B (%.0f B) | |\n", mem.Tenants, mem.KeyBooked, mem.LedgerPer)
	p("| memory per parked task in its tenant's line, MEMORY USAGE of the keys | %.0f B | |\n", mem.KeyLine)
	p("| the same two from INFO used_memory (less client buffers; moves by megabytes with the connections' buffers) | %.0f B, %.0f B | |\n\n", mem.BookedBytes, mem.LineBytes)

	p("| busy |")
	for _, b := range r.Busy {
		p(" %s (horizon %s, %d tenants) |", b.Rule, b.Horizon, b.Tenants)
	}
	p(" target |\n|---|%s---|\n", strings.Repeat("---:|", len(r.Busy)))
	rows := []struct {
		name, id, bound string
		cell            func(b *fleetBusy) string
	}{
		{"tasks; parked at least once; never parked", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%d; %d; %d", b.Tasks, b.ParkedTasks, b.Straight) }},
		{"parked tasks started on a booked turn / on a new turn (back later than the tolerance)", "", "", func(b *fleetBusy) string {
			return fmt.Sprintf("%d / %d", b.Redeemed, b.NewTurn)
		}},
		{"tasks never started / started twice", "once", "0", func(b *fleetBusy) string { return fmt.Sprintf("%d / %d", b.Lost, b.Doubled) }},
		{"limiter calls per parked task ((calls − tasks never parked) / parked tasks)", "limiter", "≤ 2.05", func(b *fleetBusy) string { return fmt.Sprintf("%.4f", b.PerParked) }},
		{"limiter calls per task, all tasks", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%.3f", b.PerTask) }},
		{"park decisions per parked task", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%.3f", float64(b.Parks)/float64(max(b.ParkedTasks, 1))) }},
		{"ledger looks per parked task (of which took nothing)", "looks", "≤ 0.2", func(b *fleetBusy) string { return fmt.Sprintf("%.3f (%.3f)", b.LooksPer, b.EmptyPer) }},
		{"ledger writes per parked task", "writes", "≤ 1", func(b *fleetBusy) string { return fmt.Sprintf("%.4f", b.WritesPer) }},
		{"Redis calls per task, every command of every worker", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%.2f", b.CallsPerRun) }},
		{"Redis calls per second per worker", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%.2f", b.PerWorkerS) }},
		{"parked tasks' start after the slot they were parked for, p50 / p99 / max", "", "", func(b *fleetBusy) string {
			s := fmt.Sprintf("%.1f / %.1f / %.1f ms", b.LateP50Ms, b.LateP99Ms, b.LateMaxMs)
			if b.LateUnknown > 0 {
				s += fmt.Sprintf(" (%d in line, slot unknown, left out)", b.LateUnknown)
			}
			return s
		}},
		{fmt.Sprintf("load average while busy, min–max (mean), %d cores", r.Machine.NProc), "", "", func(b *fleetBusy) string {
			return fmt.Sprintf("%.1f–%.1f (%.1f)", b.LoadMin, b.LoadMax, b.LoadMean)
		}},
		{"drain time (ideal: arrivals + the tenants' own spacing)", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%.1f s (%.1f s)", b.DurationS, b.IdealS) }},
		{"most tasks parked at once", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%d", b.PeakParked) }},
		{"admission errors (retried) / wake-ups not recorded", "", "", func(b *fleetBusy) string { return fmt.Sprintf("%d / %d", b.Errors, b.Fallbacks) }},
	}
	for _, x := range rows {
		p("| %s |", x.name)
		for _, b := range r.Busy {
			p(" %s |", x.cell(b))
		}
		if x.id == "" {
			p(" |\n")
			continue
		}
		var vs []string
		for _, b := range r.Busy {
			vs = append(vs, b.Rule+" "+verdict[x.id+"/"+b.Rule])
		}
		p(" %s: %s |\n", x.bound, strings.Join(vs, ", "))
	}
	p("\n")
	for _, b := range r.Busy {
		for _, e := range b.LostExamples {
			p("- %s, never started: %s\n", b.Rule, e)
		}
		for _, e := range b.Stuck {
			p("- %s, in the ledger when the case ended: %s\n", b.Rule, e)
		}
	}
}

// perRule lists the limiter calls per second of each rule that made any.
func perRule(calls map[string]int64, d float64) string {
	var parts []string
	for _, r := range []string{bookedRule, linedRule, holdRule} {
		if calls[r] > 0 {
			parts = append(parts, fmt.Sprintf("%s %.1f", r, float64(calls[r])/d))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// perSecond lists the commands of every master per second, most first.
func perSecond(nodes map[string]fleetNode, d float64) string {
	all := map[string]int64{}
	for _, n := range nodes {
		for k, v := range n.ByCommand {
			all[k] += v
		}
	}
	names := make([]string, 0, len(all))
	for k := range all {
		names = append(names, k)
	}
	slices.SortFunc(names, func(a, b string) int { return int(all[b] - all[a]) })
	var parts []string
	for _, k := range names {
		parts = append(parts, fmt.Sprintf("%s %.1f", strings.ToUpper(k), float64(all[k])/d))
	}
	return strings.Join(parts, ", ")
}

func renderFleetNodes(p func(string, ...any), r *fleetResult) {
	idle := r.Idle
	addrs := make([]string, 0, len(idle.Nodes))
	for a := range idle.Nodes {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)
	p("Per master: the ledger's load per shard (each master holds one shard; looks and writes are the workers' own counts on that shard's key), and every client command as INFO commandstats counts it (a script's own calls left out; PUBLISH counts the scripts' PUBLISH and SPUBLISH):\n\n")
	p("| master | ledger shard | idle calls/s | connections |")
	for _, b := range r.Busy {
		p(" %s: calls | EVALSHA | PUBLISH | CPU s | ledger looks / writes |", b.Rule)
	}
	p("\n|---|---|---:|---:|%s\n", strings.Repeat("---:|---:|---:|---:|---|", len(r.Busy)))
	for _, a := range addrs {
		shard, si := "—", -1
		for i, s := range r.Ledger {
			if s.Node == a {
				shard, si = fmt.Sprintf("%d (`%s`)", i, s.Key), i
			}
		}
		p("| %s | %s | %.1f | %d |", a, shard, float64(idle.Nodes[a].Calls)/idle.DurationS, idle.Nodes[a].Clients)
		for _, b := range r.Busy {
			n, lw := b.Nodes[a], "—"
			if si >= 0 && si < len(b.Looks) {
				lw = fmt.Sprintf("%d / %d", b.Looks[si], b.Writes[si])
			}
			p(" %d | %d | %d | %.1f | %s |", n.Calls, n.ByCommand["evalsha"]+n.ByCommand["eval"], n.Publishes, n.CPUS, lw)
		}
		p("\n")
	}
	p("\n")
}

// renderFleetExtrapolation writes what 10,000 workers would cost, from the
// per-worker and per-task figures measured.
func renderFleetExtrapolation(p func(string, ...any), r *fleetResult) {
	idle, c := r.Idle, r.Config
	scale := 10_000 / float64(c.Workers)
	var busiestIdle, conns float64
	minConns := math.Inf(1)
	for _, n := range idle.Nodes {
		busiestIdle = max(busiestIdle, float64(n.Calls)/idle.DurationS)
		conns = max(conns, float64(n.Clients))
		minConns = min(minConns, float64(n.Clients))
	}
	p("**Extrapolation to 10,000 workers** (×%.0f the workers; from the measured costs, not run):\n\n", scale)
	fleetPerS := idle.PerWorkerPerS * float64(c.Workers)
	pings := float64(c.Shards) / 60 // a subscription per shard, pinged once a minute when quiet
	p("- *Idle does not grow with workers:* the fleet made %.1f calls/s (%.3f per worker per second), the holders' idle looks and the standbys' checks of the shards' watches, "+
		"a number per shard whatever the workers (with the defaults at most 0.5 holders' looks and one check per shard a second, %d); the busiest master took %.1f/s. Add each subscription's PING, once a minute when it hears nothing "+
		"(a subscription per shard and worker on a cluster: %.3f per worker per second, after this 30-s window), so 10,000 idle workers cost about %.0f calls/s. "+
		"Connections: %.0f to %.0f per master for %d workers (%.1f per worker: each worker's client and one subscription per master), so about %.0f per master at 10,000, "+
		"beyond Redis's default maxclients of 10,000, which the clients' own connections alone reach.\n",
		fleetPerS, idle.PerWorkerPerS, c.Shards, busiestIdle, pings, fleetPerS+pings*10_000, minConns, conns, c.Workers, conns/float64(c.Workers), conns*scale)
	for _, b := range r.Busy {
		renderFleetBusyScale(p, r, b, scale)
	}
	p("\nCounts (calls per task, per worker, per second idle) do not depend on the machine's load; the lateness and the drain time do: on %d shared cores the %d workers, "+
		"three masters and other sessions' work compete for the CPU.\n", r.Machine.NProc, c.Workers)
}

// renderFleetBusyScale writes one busy case's part of the extrapolation.
func renderFleetBusyScale(p func(string, ...any), r *fleetResult, b *fleetBusy, scale float64) {
	var pubs int64
	var busiestCPU, cpuPerCall float64
	for _, n := range b.Nodes {
		pubs += n.Publishes
		busiestCPU = max(busiestCPU, n.CPUS)
		if n.Calls > 0 {
			cpuPerCall = max(cpuPerCall, n.CPUS/float64(n.Calls))
		}
	}
	w, d := float64(r.Config.Workers), max(b.DurationS, 1)
	looksPerS := float64(sum64(b.Looks)) / d
	p("- *Busy, %s:* the limiter calls (%.3f per parked task) and the ledger writes (%.3f) grow with the tasks, not the workers, and so do the looks: the holder of each shard's watch "+
		"looks as its wake-ups come due (at most one a Tick) and the others check each watch about once a second between them, so the fleet's %.1f looks/s here (%.3f per parked task) "+
		"stay about the same at 10,000 workers for the same tasks. "+
		"A message a script publishes (a wake-up that became its shard's first, a watch taken) goes to every worker's subscription of that shard, on the shard's master: "+
		"%d publishes reached %.0f subscribers each, %.0f deliveries, ×%.0f at 10,000. ",
		b.Rule, b.PerParked, b.WritesPer, looksPerS, b.LooksPer, pubs, w, float64(pubs)*w, scale)
	if cpuPerCall > 0 {
		p("One master: the busiest spent %.1f CPU s, %.1f µs per client call on this shared machine (the scripts' work included), so one core serves about %.0f calls/s.",
			busiestCPU, cpuPerCall*1e6, 1/cpuPerCall)
	}
	p("\n")
}

// rewriteFleetSection rewrites the fleet section of the report at mdPath
// from the results file at path (-fleet-report), running nothing.
func rewriteFleetSection(path, mdPath string) error {
	var r fleetResult
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("bench: %s: %w", path, err)
	}
	r.Targets = fleetTargets(&r)
	return writeFleetSection(&r, "bench/"+filepath.ToSlash(path), mdPath)
}
