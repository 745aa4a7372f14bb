package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// What a leased child saw of its own leases (issue 25, item 4: why the
// leased mode collapses on a loaded machine): how many lease calls it made
// and how large they were, how long they took, how many requests went to
// Redis on their own (the exact path, a lease's fallback), how late a
// 1 ms sleep woke, and the most goroutines at once.

// leaseProbe is a child's record of its lease calls, as a go-redis hook:
// a reserve of more than one permit is a lease call (the bench asks one
// permit at a time), a reserve of one or an allow is the exact path.
type leaseProbe struct {
	mu      sync.Mutex
	calls   int64
	permits int64
	rtt     []time.Duration // lease calls' round trips
	exact   int64           // reserve of 1, allow: requests Redis decided alone
}

// leaseStats is what a child reports of its leases and its scheduler.
type leaseStats struct {
	Calls      int64   `json:"lease_calls"`
	Permits    int64   `json:"leased_permits"`
	Exact      int64   `json:"exact_calls"`            // requests sent to Redis on their own
	RTTp50Us   float64 `json:"lease_rtt_p50_us"`       // a lease call's round trip
	RTTp99Us   float64 `json:"lease_rtt_p99_us"`       //
	RTTMaxUs   float64 `json:"lease_rtt_max_us"`       //
	SleepP50Us float64 `json:"sleep_over_p50_us"`      // how late a 1 ms sleep woke
	SleepP99Us float64 `json:"sleep_over_p99_us"`      //
	Goroutines int     `json:"max_goroutines"`         // sampled every 10 ms
	RTTs       []int64 `json:"lease_rtt_us,omitempty"` // every lease call's round trip, µs (merged by the parent)
	Sleeps     []int64 `json:"sleep_over_us,omitempty"`
}

func (p *leaseProbe) DialHook(next redis.DialHook) redis.DialHook { return next }

func (p *leaseProbe) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		op, n := scriptOp(cmd)
		if op != "reserve" || n <= 1 {
			if op == "allow" || op == "reserve" {
				p.mu.Lock()
				p.exact++
				p.mu.Unlock()
			}
			return next(ctx, cmd)
		}
		t := time.Now()
		err := next(ctx, cmd)
		d := time.Since(t)
		p.mu.Lock()
		p.calls++
		p.permits += int64(n)
		p.rtt = append(p.rtt, d)
		p.mu.Unlock()
		return err
	}
}

func (p *leaseProbe) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if op, _ := scriptOp(cmd); op == "allow" || op == "reserve" {
				p.mu.Lock()
				p.exact++
				p.mu.Unlock()
			}
		}
		return next(ctx, cmds)
	}
}

// scriptOp is a script call's operation (ARGV[1]) and permits (ARGV[2]).
func scriptOp(cmd redis.Cmder) (string, int) {
	if !isScript(cmd.Name()) {
		return "", 0
	}
	args := cmd.Args()
	nk, ok := asInt(args[2])
	if !ok || len(args) <= 4+nk {
		return "", 0
	}
	op, _ := args[3+nk].(string)
	n, _ := asInt(args[4+nk])
	return op, n
}

// schedProbe samples, until stop, how late a 1 ms sleep wakes and how
// many goroutines run.
type schedProbe struct {
	over       []time.Duration
	goroutines atomic.Int64
	done       chan struct{}
}

func startSchedProbe(stop <-chan struct{}) *schedProbe {
	s := &schedProbe{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			t := time.Now()
			time.Sleep(time.Millisecond)
			s.over = append(s.over, time.Since(t)-time.Millisecond)
			if i%10 == 0 {
				if g := int64(runtime.NumGoroutine()); g > s.goroutines.Load() {
					s.goroutines.Store(g)
				}
			}
		}
	}()
	return s
}

// start starts the scheduler probe and, if asked for, the profiles of
// child w; finish ends them and returns what the probes saw.
func (p *leaseProbe) start(w workload) (finish func() *leaseStats) {
	stopProfile := profileChild(w)
	stop := make(chan struct{})
	sched := startSchedProbe(stop)
	return func() *leaseStats {
		close(stop)
		stopProfile()
		return p.stats(sched)
	}
}

// stats ends the probes and returns what they saw.
func (p *leaseProbe) stats(s *schedProbe) *leaseStats {
	<-s.done
	p.mu.Lock()
	defer p.mu.Unlock()
	st := &leaseStats{Calls: p.calls, Permits: p.permits, Exact: p.exact, Goroutines: int(s.goroutines.Load())}
	for _, d := range p.rtt {
		st.RTTs = append(st.RTTs, d.Microseconds())
	}
	for _, d := range s.over {
		st.Sleeps = append(st.Sleeps, d.Microseconds())
	}
	st.summarize()
	return st
}

// summarize sets the percentiles from RTTs and Sleeps.
func (st *leaseStats) summarize() {
	r, s := slices.Sorted(slices.Values(st.RTTs)), slices.Sorted(slices.Values(st.Sleeps))
	st.RTTp50Us, st.RTTp99Us, st.RTTMaxUs = pctl(r, 0.5), pctl(r, 0.99), pctl(r, 1)
	st.SleepP50Us, st.SleepP99Us = pctl(s, 0.5), pctl(s, 0.99)
}

func pctl(sorted []int64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return float64(sorted[min(int(q*float64(len(sorted))), len(sorted)-1)])
}

// merge adds a child's stats to a case's (every sample kept until
// summarize).
func (st *leaseStats) merge(o *leaseStats) {
	st.Calls += o.Calls
	st.Permits += o.Permits
	st.Exact += o.Exact
	st.Goroutines = max(st.Goroutines, o.Goroutines)
	st.RTTs = append(st.RTTs, o.RTTs...)
	st.Sleeps = append(st.Sleeps, o.Sleeps...)
}

// profileChild writes a CPU, mutex and block profile of this child to
// $BENCH_LEASED_PPROF/<base of w.File>.{cpu,mutex,block}.pprof, if set;
// stop ends them.
func profileChild(w workload) (stop func()) {
	dir := os.Getenv("BENCH_LEASED_PPROF")
	if dir == "" || w.File == "" {
		return func() {}
	}
	base := filepath.Join(dir, filepath.Base(w.File))
	f, err := os.Create(base + ".cpu.pprof")
	if err != nil {
		return func() {}
	}
	runtime.SetMutexProfileFraction(10)
	runtime.SetBlockProfileRate(int(100 * time.Microsecond))
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
		for _, name := range []string{"mutex", "block"} {
			if g, err := os.Create(base + "." + name + ".pprof"); err == nil {
				pprof.Lookup(name).WriteTo(g, 0)
				g.Close()
			}
		}
	}
}

// startBurners starts a process of n spinning goroutines (GOMAXPROCS n)
// for d from start, as another session's work: its own session (so its
// own autogroup) at nice 0, whatever the bench's priority; or, if same, in
// the bench's own session at its priority, as another benchmark run beside
// it would be. It adds about n to the machine's load.
func startBurners(exe string, n int, start time.Time, d time.Duration, same bool) (*exec.Cmd, error) {
	spec, err := json.Marshal(workload{Mode: "burn", Waiters: n, StartUnixNano: start.UnixNano(), Duration: d, Apart: !same})
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-child", string(spec))
	cmd.Env = append(os.Environ(), fmt.Sprintf("GOMAXPROCS=%d", n))
	apart(cmd, !same)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start burners: %w", err)
	}
	return cmd, nil
}

// leasedBurners starts cfg.Burners burners for the leased part, if any;
// stop ends them.
func leasedBurners(exe string, cfg leasedConfig, logf func(string, ...any)) (stop func(), err error) {
	if cfg.Burners <= 0 {
		return func() {}, nil
	}
	burn, err := startBurners(exe, cfg.Burners, time.Now(), time.Hour, cfg.BurnSame)
	if err != nil {
		return nil, err
	}
	logf("leased: %d burners beside the run (pid %d)", cfg.Burners, burn.Process.Pid)
	return func() { burn.Process.Kill(); burn.Wait() }, nil
}

// logLeasedCase logs a case's figures, and its children's lease record.
func logLeasedCase(logf func(string, ...any), c *leasedCase) {
	logf("leased: %s: %.0f permits/s, max 1 s %d (over %+d, %.2f %%), Redis CPU %.3f µs/permit, %.4f scripts/permit, Jain %.4f, load %.2f",
		c.Name, c.SteadyPS, c.Max1s, c.Over1s, c.OverPct, c.RedisCPU, c.Scripts, c.Jain, c.Load)
	if st := c.Lease; st != nil {
		logf("leased: %s: %d lease calls, %.1f permits each, lease rtt p50 %.0f p99 %.0f max %.0f µs; %d exact calls; 1 ms sleep late p50 %.0f p99 %.0f µs; %d goroutines at most",
			c.Name, st.Calls, float64(st.Permits)/float64(max(st.Calls, 1)), st.RTTp50Us, st.RTTp99Us, st.RTTMaxUs, st.Exact, st.SleepP50Us, st.SleepP99Us, st.Goroutines)
	}
}
