package throttle

import (
	"embed"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"
)

// The Lua sources. Each script's file starts with its KEYS, ARGV and
// reply; each algorithm's file documents its state, its TTL and its refund
// ticket; prelude.lua holds what every script shares.
//
//go:embed lua/*.lua
var luaFiles embed.FS

// A scriptSet is a policy's scripts, one per operation, each built over
// the same algorithm files, so that a policy's rules are decided in one
// atomic call whatever the operation. allow, reserve and atmost share one
// script (lua/allow.lua): their KEYS and ARGV have one layout; refund and
// undo share lua/refund.lua. Every script's ARGV[1] is its operation,
// which prelude.lua reads (rare) and the tests count calls by.
type scriptSet struct {
	allow, prepay, admit, refund, settle, pause, learn *redis.Script
}

// scripts holds the scripts of each algorithm alone, used by
// single-algorithm limiters, and allScripts those with every algorithm,
// for policies that mix them.
var (
	scripts    = map[Algorithm]*scriptSet{}
	allScripts *scriptSet
)

func init() {
	var all []string
	for _, a := range registered() {
		files := a.spec().files
		scripts[a] = newScriptSet(files, "use_"+string(a)+".lua")
		for _, f := range files {
			if !slices.Contains(all, f) {
				all = append(all, f)
			}
		}
	}
	allScripts = newScriptSet(all, "use_all.lua")
}

// newScriptSet builds each operation's script as time.lua, prelude.lua,
// the algorithm files, use (a use_*.lua file), rules.lua and the
// operation's files. Each algorithm file defines check_<name> and
// commit_<name>; the use_*.lua file hands them to the scripts: directly in
// a script of one algorithm (use_<name>.lua), by name in a table in the
// script for policies mixing algorithms (use_all.lua).
func newScriptSet(algorithms []string, use string) *scriptSet {
	head := append(append([]string{"prelude.lua"}, algorithms...), use, "rules.lua")
	build := func(files ...string) *redis.Script { return buildScript(append(slices.Clip(head), files...)...) }
	return &scriptSet{
		allow:  build("decide.lua", "allow.lua"),
		prepay: build("decide.lua", "prepay.lua"),
		admit:  build("upstream_rate.lua", "upstream_pace.lua", "limits_pace.lua", "decide.lua", "status.lua", "line.lua", "line_serve.lua", "admit.lua"),
		refund: build("refund.lua"),
		settle: build("limits_pace.lua", "settle.lua"),
		pause:  build("pause.lua"),
		learn:  build("limits_pace.lua", "learn_limits.lua"),
	}
}

// of returns the script of operation o.
func (s *scriptSet) of(o op) *redis.Script {
	switch o {
	case opPrepay:
		return s.prepay
	case opAdmit:
		return s.admit
	case opRefund, opUndo:
		return s.refund
	case opSettle:
		return s.settle
	case opPause:
		return s.pause
	}
	return s.allow // allow, reserve, atmost
}

// buildScript concatenates time.lua (Redis's clock, read first by every
// script) and embedded Lua files, in order, into one script, named after
// the last (ScriptName). Script text is only ever these constant files:
// user data reaches Redis as KEYS and ARGV.
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
	s := redis.NewScript(b.String())
	scriptNames[s.Hash()] = strings.TrimSuffix(files[len(files)-1], ".lua")
	return s
}

// scriptNames maps the SHA1 of every script this package sends to its
// name. Every script is built while the package initialises; nothing
// writes it after.
var scriptNames = map[string]string{}

// ScriptName returns the name of the script whose SHA1 is sha (in hex, as
// EVALSHA sends it), if this package sends it: the operation it serves,
// the last of the Lua files it is made of ("admit", "allow", "bucket_fast",
// "upstream_depart", "upstream_leave", …). Several scripts can share a
// name (each algorithm has its own "allow"). For counting the calls a
// process sends by what they do (worker.Metrics.CountRedisCalls).
func ScriptName(sha string) (string, bool) {
	name, ok := scriptNames[sha]
	return name, ok
}

// scriptsFor returns the smallest scripts that cover every rule.
func scriptsFor(rules []Rule) *scriptSet {
	for _, r := range rules[1:] {
		if r.Algorithm != rules[0].Algorithm {
			return allScripts
		}
	}
	return scripts[rules[0].Algorithm]
}

// fastBucketScript decides the commonest bucket call on its own
// (lua/bucket_fast.lua): an allow or reserve under one token bucket or
// GCRA rule whose interval is a whole number of µs and whose burst lasts
// under 2^40 − 1 µs (fastRule), with allow.lua's reply. It is a small
// script, which is most of why it costs Redis less per call: the Lua
// collector walks every loaded script about every 50 calls (BENCHMARKS.md,
// server cost). Its ARGV are the ones it reads (op, n, period in µs,
// burst, and a reserve's max wait), not allow.lua's eight: each argument
// costs Redis an object and a Lua string per call. A call whose state it cannot read it
// hands back (handedBack), unchanged, and the runner sends allow.lua's
// form of it (allowLine) to the limiter's own script.
var fastBucketScript = buildScript("bucket_fast.lua")

// fastBurstLimit bounds the burst, in µs, that bucket_fast.lua's compact
// state holds: under 2^40 − 1 µs, 12.7 days (bucket.lua: 2^40 − 1 stands
// for no reservation on record).
const fastBurstLimit = 1<<40 - 1

// fastArgs is how many arguments a reserve of fastBucketScript has, an
// allow one fewer (fastLine, policy.go); a call of allow.lua has 3 + 5
// per rule, never 4 or 5.
const fastArgs = 5

// fastRule reports whether allow and reserve calls of a policy of one rule
// of algorithm a, count and period (µs, in lowest terms) and extra (the
// burst) go to fastBucketScript.
func fastRule(a Algorithm, count, period, extra int64) bool {
	return (a == TokenBucket || a == GCRA) && count == 1 && period >= 1 && extra >= 1 && extra <= (fastBurstLimit-1)/period
}

// fastScript returns fastBucketScript if line (run.go) is a call of it to
// one of the one-rule bucket scripts: one key, and fastArgs arguments, or
// one fewer (op, n, period, extra, and a reserve's max wait: fastLine)
// that only the policy of a fastRule builds; nil otherwise.
func fastScript(script *redis.Script, line []any) *redis.Script {
	nkeys, args := lineArgs(line)
	if nkeys != 1 || len(args) < fastArgs-1 || len(args) > fastArgs || (script != scripts[TokenBucket].allow && script != scripts[GCRA].allow) {
		return nil
	}
	return fastBucketScript
}

// allowLine returns allow.lua's form of line, a call of fastBucketScript
// that script (fastScript) must decide instead: allow.lua's ARGV (op, n,
// max wait, algorithm, count 1, period, extra, no ticket).
func allowLine(script *redis.Script, line []any) []any {
	a := GCRA
	if script == scripts[TokenBucket].allow {
		a = TokenBucket
	}
	_, args := lineArgs(line)
	bound := noBound
	if len(args) == fastArgs {
		bound = args[4]
	}
	o := args[0]
	if o == answerOnly {
		o = opAllow.arg()
	}
	d := newLine(1, 8)
	d[lineHead] = line[lineHead]
	copy(d[lineHead+1:], []any{o, args[1], bound, string(a), int64(1), args[2], args[3], ""})
	return d
}

// handedBack reports whether cmd is fastBucketScript's answer that it
// cannot decide the call (an empty array: allow.lua never replies one).
func handedBack(cmd *redis.Cmd) bool {
	reply, ok := cmd.Val().([]any)
	return ok && len(reply) == 0 && cmd.Err() == nil
}
