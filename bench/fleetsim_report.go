package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
)

// fleetHeading starts the fleet part's section of BENCHMARKS.md; the
// section runs to the next "## " heading or the end.
const fleetHeading = "## A fleet of 1,000 workers, simulated (issue 25)"

// fleetTargets are issue 25's targets that the fleet part measures.
func fleetTargets(r *fleetResult) []target {
	b, idle := r.Busy, r.Idle
	check := func(id, goal string, met bool, worst string) target {
		t := target{ID: id, Goal: goal, Checks: 1, Met: met, Worst: worst}
		if !met {
			t.Failures = []string{worst}
		}
		return t
	}
	return []target{
		check("idle", "idle: ≤ 1 Redis call per second per worker", idle.PerWorkerPerS <= 1,
			fmt.Sprintf("%.3f per worker per second (%d calls, %d workers, %.1f s)", idle.PerWorkerPerS, idle.Calls, r.Config.Workers, idle.DurationS)),
		check("looks", "busy: ≤ 0.2 ledger looks per parked task", b.LooksPer <= 0.2,
			fmt.Sprintf("%.3f looks per parked task, %.3f of them took nothing", b.LooksPer, b.EmptyPer)),
		check("limiter", "busy: ≤ 2.05 limiter calls per parked task", b.PerParked <= 2.05,
			fmt.Sprintf("%.3f per parked task (%.3f per task)", b.PerParked, b.PerTask)),
		check("writes", "busy: ≤ 1 ledger write per parked task", b.WritesPer <= 1, fmt.Sprintf("%.3f per parked task", b.WritesPer)),
		check("exactly-once", "0 wake-ups lost or doubled", b.Lost == 0 && b.Doubled == 0,
			fmt.Sprintf("%d tasks never started, %d started twice, of %d", b.Lost, b.Doubled, b.Tasks)),
	}
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
		"so a wake-up taken by any process brings it back there. Every limiter call is a real script call. Tenants: %d, rule GCRA one task per %v per tenant (burst 1, the default MaxWait, "+
		"WaitSlots and Horizon%s), %d tasks per tenant enqueued together, the tenants arriving evenly over %v.\n\n",
		c.Workers, c.Procs, c.Shards, c.Concurrency, c.Tenants, c.Interval, horizonNote(c), c.PerTenant, c.Arrival)
	renderFleetTable(p, r)
	renderFleetNodes(p, r)
	renderFleetExtrapolation(p, r)
	return b.String()
}

func horizonNote(c fleetConfig) string {
	if c.Horizon == 0 {
		return ""
	}
	return fmt.Sprintf(", except Horizon %v", c.Horizon)
}

func renderFleetTable(p func(string, ...any), r *fleetResult) {
	b, idle, mem := r.Busy, r.Idle, r.Memory
	verdict := map[string]string{}
	for _, t := range r.Targets {
		verdict[t.ID] = map[bool]string{true: "met", false: "**not met**"}[t.Met]
	}
	p("| figure | value | target |\n|---|---:|---|\n")
	p("| idle: Redis calls per second per worker (clients' commands on the masters, %.0f s, no task) | %.3f | ≤ 1: %s |\n", idle.DurationS, idle.PerWorkerPerS, verdict["idle"])
	p("| idle: the same, total for the fleet | %.0f/s | |\n", float64(idle.Calls)/idle.DurationS)
	p("| idle: by command, fleet per second | %s | |\n", perSecond(idle.Nodes, idle.DurationS))
	p("| idle: hooked commands per worker per second, least / median / most active worker | %.2f / %.2f / %.2f | |\n", idle.WorkerMin, idle.WorkerMedian, idle.WorkerMax)
	p("| busy: tasks; parked (started on a booked turn); started on a new turn | %d; %d; %d | |\n", b.Tasks, b.Redeemed, b.Straight)
	p("| busy: tasks never started / started twice | %d / %d | 0: %s |\n", b.Lost, b.Doubled, verdict["exactly-once"])
	p("| busy: limiter calls per parked task ((calls − new turns) / parked) | %.3f | ≤ 2.05: %s |\n", b.PerParked, verdict["limiter"])
	p("| busy: limiter calls per task, all tasks | %.3f | |\n", b.PerTask)
	p("| busy: park decisions per parked task | %.3f | |\n", float64(b.Parks)/float64(max(b.Redeemed, 1)))
	p("| busy: ledger looks per parked task (of which took nothing) | %.3f (%.3f) | ≤ 0.2: %s |\n", b.LooksPer, b.EmptyPer, verdict["looks"])
	p("| busy: ledger writes per parked task | %.3f | ≤ 1: %s |\n", b.WritesPer, verdict["writes"])
	p("| busy: Redis calls per task, every command of every worker | %.2f | |\n", b.CallsPerRun)
	p("| busy: Redis calls per second per worker | %.2f | |\n", b.PerWorkerS)
	p("| busy: start lateness after the booked slot, p50 / p99 / max (load %.1f–%.1f, mean %.1f, on %d cores) | %.1f / %.1f / %.1f ms | on time |\n",
		b.LoadMin, b.LoadMax, b.LoadMean, r.Machine.NProc, b.LateP50Ms, b.LateP99Ms, b.LateMaxMs)
	p("| busy: drain time (ideal: arrivals + the tenants' own spacing) | %.1f s (%.1f s) | |\n", b.DurationS, b.IdealS)
	p("| busy: most tasks parked at once | %d | |\n", b.PeakParked)
	p("| memory per parked task, booked turn (used_memory less client buffers, %d tenants) | %.0f B (ledger entry %.0f B) | |\n", mem.Tenants, mem.BookedBytes, mem.LedgerPer)
	p("| memory per parked task, in the tenant's line | %.0f B | |\n", mem.LineBytes)
	if b.Errors+b.Fallbacks > 0 {
		p("| busy: admission errors (retried) / wake-ups not recorded | %d / %d | |\n", b.Errors, b.Fallbacks)
	}
	p("\n")
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
	b, idle := r.Busy, r.Idle
	addrs := make([]string, 0, len(b.Nodes))
	for a := range b.Nodes {
		addrs = append(addrs, a)
	}
	slices.Sort(addrs)
	p("Per master (the ledger's load per shard: the client counts of looks and writes on the shard that master holds; calls are the clients' commands as INFO commandstats counts them):\n\n")
	p("| master | ledger shard | idle calls/s | busy calls | busy EVALSHA | busy PUBLISH (scripts) | busy CPU s | ledger looks / writes (busy) | connections | share of booked parks' memory |\n")
	p("|---|---|---:|---:|---:|---:|---:|---|---:|---:|\n")
	for _, a := range addrs {
		shard, lw := "—", "—"
		for i, s := range r.Ledger {
			if s.Node == a && i < len(b.Looks) {
				shard, lw = fmt.Sprintf("%d (`%s`)", i, s.Key), fmt.Sprintf("%d / %d", b.Looks[i], b.Writes[i])
			}
		}
		n := b.Nodes[a]
		p("| %s | %s | %.1f | %d | %d | %d | %.1f | %s | %d | %.3f |\n", a, shard, float64(idle.Nodes[a].Calls)/idle.DurationS, n.Calls,
			n.ByCommand["evalsha"]+n.ByCommand["eval"], n.Publishes, n.CPUS, lw, n.Clients, r.Memory.BookedShare[a])
	}
	p("\n")
}

// renderFleetExtrapolation writes what 10,000 workers would cost, from the
// per-worker and per-task figures measured.
func renderFleetExtrapolation(p func(string, ...any), r *fleetResult) {
	b, idle, c := r.Busy, r.Idle, r.Config
	scale := 10_000 / float64(c.Workers)
	var busiestIdle, busiestCPU, cpuPerCall float64
	var conns int64
	for a, n := range b.Nodes {
		busiestIdle = max(busiestIdle, float64(idle.Nodes[a].Calls)/idle.DurationS)
		busiestCPU = max(busiestCPU, n.CPUS)
		conns += n.Clients
		if n.Calls > 0 {
			cpuPerCall = max(cpuPerCall, n.CPUS/float64(n.Calls))
		}
	}
	pubs := int64(0)
	for _, n := range b.Nodes {
		pubs += n.Publishes
	}
	p("**Extrapolation to 10,000 workers** (×%.0f the workers; from the measured costs, not run):\n\n", scale)
	p("- *Grows with workers:* the idle cost, %.3f calls per worker per second, is %.0f calls/s for 10,000 idle workers (%.0f/s on the busiest master here, so about %.0f/s there). "+
		"Connections: %d on the masters for %d workers (%.1f per worker), so about %.0f for 10,000 (Redis's default maxclients is 10,000 per master). "+
		"Each wake-up a script publishes (a wake-up that became its shard's first) goes to every worker's subscription: %d publishes in the busy phase reached %d subscribers each, "+
		"%.0f deliveries; at 10,000 workers ten times as many per publish.\n",
		idle.PerWorkerPerS, idle.PerWorkerPerS*10_000, busiestIdle, busiestIdle*scale, conns, c.Workers, float64(conns)/float64(c.Workers), float64(conns)*scale, pubs, c.Workers, float64(pubs)*float64(c.Workers))
	p("- *Grows with tasks, not workers:* %.3f limiter calls and %.3f ledger writes per parked task, %.2f Redis calls per task in all; the looks per parked task (%.3f) "+
		"are the part that also grows with the workers while busy (a loop that left a shard to another still looks there once a second).\n",
		b.PerParked, b.WritesPer, b.CallsPerRun, b.LooksPer)
	if cpuPerCall > 0 {
		p("- *What one master takes:* the busiest master spent %.1f CPU s in the busy phase, %.1f µs per client call on this shared machine, so one core "+
			"serves about %.0f calls/s; 10,000 idle workers spread over three masters need about %.0f%% of one core each for their idle calls alone.\n",
			busiestCPU, cpuPerCall*1e6, 1/cpuPerCall, idle.PerWorkerPerS*10_000/3*cpuPerCall*100)
	}
	p("\nCounts (calls per task, per worker, per second idle) do not depend on the machine's load; the lateness and the drain time do: on %d shared cores the %d workers, "+
		"three masters and other sessions' work compete for the CPU.\n", r.Machine.NProc, c.Workers)
}
