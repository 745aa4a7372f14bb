package throttle

import (
	"embed"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"
)

// The Lua sources. Each algorithm's file documents its state, its TTL and
// its refund ticket; driver.lua documents KEYS, ARGV and the reply shared
// by all scripts.
//
//go:embed lua/*.lua
var luaFiles embed.FS

// scripts holds one script per algorithm (prelude + that algorithm +
// driver), used by single-algorithm limiters, and one with every algorithm
// for policies that mix them. All are the same driver over the same
// algorithm code, so a policy's rules are decided in one atomic call
// whatever their algorithms.
var (
	scripts   = map[Algorithm]*redis.Script{}
	allScript *redis.Script
)

func init() {
	all := []string{"prelude.lua"}
	for _, a := range registered() {
		files := a.spec().files
		scripts[a] = buildScript(append(append([]string{"prelude.lua"}, files...), "use_"+string(a)+".lua", "upstream_rate.lua", "upstream_pace.lua", "driver.lua")...)
		for _, f := range files {
			if !slices.Contains(all, f) {
				all = append(all, f)
			}
		}
	}
	allScript = buildScript(append(all, "use_all.lua", "upstream_rate.lua", "upstream_pace.lua", "driver.lua")...)
}

// buildScript concatenates time.lua (Redis's clock, read first by every
// script) and embedded Lua files, in order, into one script. Script text
// is only ever these constant files: user data reaches Redis as KEYS and
// ARGV.
//
// A driver script is prelude.lua, the algorithm files, a use_*.lua file
// and driver.lua. Each algorithm file defines check_<name> and
// commit_<name>; the use_*.lua file hands them to the driver: directly in
// a script of one algorithm (use_<name>.lua), by name in a table in the
// script for policies mixing algorithms (use_all.lua).
func buildScript(files ...string) *redis.Script {
	var b strings.Builder
	for _, f := range append([]string{"time.lua"}, files...) {
		src, err := luaFiles.ReadFile("lua/" + f)
		if err != nil {
			panic(err)
		}
		b.Write(src)
		b.WriteByte('\n')
	}
	return redis.NewScript(b.String())
}

// scriptFor returns the smallest script that covers every rule.
func scriptFor(rules []Rule) *redis.Script {
	for _, r := range rules[1:] {
		if r.Algorithm != rules[0].Algorithm {
			return allScript
		}
	}
	return scripts[rules[0].Algorithm]
}

// fastBucketScript decides the commonest bucket call on its own
// (lua/bucket_fast.lua): an allow or reserve under one token bucket or
// GCRA rule whose interval is a whole number of µs and whose burst lasts
// under 2^40 − 1 µs (fastRule), with the driver's reply. It is a small
// script, which is most of why it costs Redis less per call: the Lua
// collector walks every loaded script about every 50 calls (BENCHMARKS.md,
// server cost). Its ARGV are the five it reads (op, n, max wait, period
// in µs, burst), not the driver's eight: each argument costs Redis an
// object and a Lua string per call. A call whose state it cannot read it
// hands back (handedBack), unchanged, and the runner sends the driver's
// form of it (driverLine) to the limiter's own script.
var fastBucketScript = buildScript("bucket_fast.lua")

// fastBurstLimit bounds the burst, in µs, that bucket_fast.lua's compact
// state holds: under 2^40 − 1 µs, 12.7 days (bucket.lua: 2^40 − 1 stands
// for no reservation on record).
const fastBurstLimit = 1<<40 - 1

// fastArgs is how many arguments a call of fastBucketScript has; a
// driver call has 3 + 5 per rule, never 5.
const fastArgs = 5

// fastRule reports whether allow and reserve calls of a policy of one rule
// of algorithm a, count and period (µs, in lowest terms) and extra (the
// burst) go to fastBucketScript.
func fastRule(a Algorithm, count, period, extra int64) bool {
	return (a == TokenBucket || a == GCRA) && count == 1 && period >= 1 && extra >= 1 && extra <= (fastBurstLimit-1)/period
}

// fastScript returns fastBucketScript if line (run.go) is a call of it to
// one of the one-rule bucket scripts: one key, and fastArgs arguments (op,
// n, max wait, period, extra) that only the policy of a fastRule builds;
// nil otherwise.
func fastScript(script *redis.Script, line []any) *redis.Script {
	nkeys, args := lineArgs(line)
	if nkeys != 1 || len(args) != fastArgs || (script != scripts[TokenBucket] && script != scripts[GCRA]) {
		return nil
	}
	return fastBucketScript
}

// driverLine returns the driver's form of line, a call of fastBucketScript
// that script (fastScript) must decide instead: the driver's ARGV (op, n,
// max wait, algorithm, count 1, period, extra, no ticket).
func driverLine(script *redis.Script, line []any) []any {
	a := GCRA
	if script == scripts[TokenBucket] {
		a = TokenBucket
	}
	_, args := lineArgs(line)
	d := newLine(1, 8)
	d[lineHead] = line[lineHead]
	copy(d[lineHead+1:], []any{args[0], args[1], args[2], string(a), int64(1), args[3], args[4], ""})
	return d
}

// handedBack reports whether cmd is fastBucketScript's answer that it
// cannot decide the call (an empty array: the driver never replies one).
func handedBack(cmd *redis.Cmd) bool {
	reply, ok := cmd.Val().([]any)
	return ok && len(reply) == 0 && cmd.Err() == nil
}
