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
		scripts[a] = buildScript(append(append([]string{"prelude.lua"}, files...), "use_"+string(a)+".lua", "driver.lua")...)
		for _, f := range files {
			if !slices.Contains(all, f) {
				all = append(all, f)
			}
		}
	}
	allScript = buildScript(append(all, "use_all.lua", "driver.lua")...)
}

// buildScript concatenates embedded Lua files, in order, into one script.
// Script text is only ever these constant files: user data reaches Redis
// as KEYS and ARGV.
//
// A driver script is prelude.lua, the algorithm files, a use_*.lua file
// and driver.lua. Each algorithm file defines check_<name> and
// commit_<name>; the use_*.lua file hands them to the driver: directly in
// a script of one algorithm (use_<name>.lua), by name in a table in the
// script for policies mixing algorithms (use_all.lua).
func buildScript(files ...string) *redis.Script {
	var b strings.Builder
	for _, f := range files {
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
