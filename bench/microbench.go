package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// microResult is one line of `go test -bench -benchmem` (hotpath_test.go).
type microResult struct {
	Name        string  `json:"name"`
	N           int64   `json:"n"`
	NsPerOp     float64 `json:"ns_per_op"`
	BytesPerOp  float64 `json:"bytes_per_op"`
	AllocsPerOp float64 `json:"allocs_per_op"`
	RTPerOp     float64 `json:"roundtrips_per_op"`
}

// hugeRate is the limit of the hot-path benchmarks: every call is
// admitted at once, so they measure the client and one round trip, never a
// sleep.
const hugeRate = 1_000_000

// microCommand is the go test invocation the run uses, from bench/.
var microCommand = []string{"test", "-run", "^$", "-bench", ".", "-benchmem", "-benchtime", "5000x", "-count", "1", "."}

// runMicro runs the hot-path benchmarks against the run's server.
func (r *runner) runMicro(ctx context.Context, dir string) ([]microResult, error) {
	cmd := exec.CommandContext(ctx, "go", microCommand...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "BENCH_REDIS_ADDR="+r.srv.Addr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("bench: go %s: %v\n%s", strings.Join(microCommand, " "), err, tail(string(out), 3000))
	}
	return parseBench(string(out)), nil
}

// parseBench reads benchmark result lines.
func parseBench(out string) []microResult {
	var res []microResult
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		name := f[0]
		if i := strings.LastIndexByte(name, '-'); i > 0 {
			if _, err := strconv.Atoi(name[i+1:]); err == nil {
				name = name[:i] // the GOMAXPROCS suffix
			}
		}
		m := microResult{Name: name, N: n}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			switch f[i+1] {
			case "ns/op":
				m.NsPerOp = v
			case "B/op":
				m.BytesPerOp = v
			case "allocs/op":
				m.AllocsPerOp = v
			case "roundtrips/op":
				m.RTPerOp = v
			}
		}
		res = append(res, m)
	}
	return res
}
