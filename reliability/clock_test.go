package reliability

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// scriptCall is one EVAL/EVALSHA as the client sent it and Redis answered.
type scriptCall struct {
	keys  []string
	argv  []string
	reply any
}

// scriptRecorder is a go-redis hook that records every script call.
type scriptRecorder struct {
	mu    sync.Mutex
	calls []scriptCall
}

func (*scriptRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*scriptRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (r *scriptRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		name := strings.ToLower(cmd.Name())
		if !strings.HasPrefix(name, "eval") {
			return err
		}
		args := cmd.Args()
		nkeys, _ := args[2].(int)
		c := scriptCall{}
		for i, a := range args[3:] {
			s := fmt.Sprint(a)
			if i < nkeys {
				c.keys = append(c.keys, s)
			} else {
				c.argv = append(c.argv, s)
			}
		}
		if rc, ok := cmd.(*redis.Cmd); ok {
			c.reply = rc.Val()
		}
		r.mu.Lock()
		r.calls = append(r.calls, c)
		r.mu.Unlock()
		return err
	}
}

// nearClientClock reports whether s, read as a number, is within a day of
// this machine's clock read as Unix time in seconds, milliseconds,
// microseconds or nanoseconds, and in which unit.
func nearClientClock(s string, now time.Time) (string, bool) {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(v) {
		return "", false
	}
	day := float64(24 * time.Hour)
	for _, u := range []struct {
		name string
		unit time.Duration
	}{{"s", time.Second}, {"ms", time.Millisecond}, {"µs", time.Microsecond}, {"ns", time.Nanosecond}} {
		clock := float64(now.UnixNano()) / float64(u.unit)
		if math.Abs(v-clock) <= day/float64(u.unit) {
			return u.name, true
		}
	}
	return "", false
}

// TestNoClientClockInScripts records every script call while every
// operation of the library runs (exercise) on every backend, and checks
// that no decision receives an absolute time from the client: no ARGV of
// an allow, reserve, prepay or pause call, and no ARGV of redeem, lies
// within a day of the client's clock in s, ms, µs or ns. Refund calls do
// carry Redis times (their tickets: the TAT or time to act the reservation
// left); each of those must be a ticket Redis itself returned earlier.
func TestNoClientClockInScripts(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			rec := &scriptRecorder{}
			b.Client.AddHook(rec)
			exercise(t, b.Client, redistest.Prefix(t))
			now := time.Now()

			rec.mu.Lock()
			defer rec.mu.Unlock()
			tickets := map[string]bool{}
			ops := map[string]int{}
			for _, c := range rec.calls {
				if len(c.argv) == 0 {
					continue
				}
				op := c.argv[0]
				if reply, ok := c.reply.([]any); ok && (op == "allow" || op == "reserve" || op == "prepay") && len(reply) > 6 {
					for _, tk := range reply[6:] {
						tickets[fmt.Sprint(tk)] = true
					}
					tickets[fmt.Sprint(reply[5])] = true // Redis now: a settle sends it back
				}
			}
			for _, c := range rec.calls {
				if len(c.argv) == 0 {
					continue
				}
				op := c.argv[0]
				switch op {
				case "allow", "reserve", "prepay", "pause", "refund", "undo", "atmost", "settle":
				default:
					op = "redeem" // admit.lua and the rest: a booking or a redeem
				}
				ops[op]++
				for i, a := range c.argv {
					unit, near := nearClientClock(a, now)
					if !near {
						continue
					}
					if (op == "refund" || op == "undo" || op == "settle") && tickets[a] {
						continue // a Redis time that Redis issued, echoed back
					}
					t.Errorf("%s call: ARGV[%d] = %s is within a day of the client's clock in %s; scripts must read Redis TIME, not the client's clock (ARGV %v)",
						op, i+1, a, unit, c.argv)
				}
			}
			t.Logf("script calls checked: %v; %d refund tickets issued by Redis", ops, len(tickets))
			for _, op := range []string{"allow", "reserve", "prepay", "pause", "refund", "redeem", "settle"} {
				if ops[op] == 0 {
					t.Errorf("no %s call was made; exercise does not cover it", op)
				}
			}
		})
	}
}

// Roles of the child process in TestTwoClocksShareOneLimit.
const roleSkewed = "skewed-clock"

// skewReport is what each process of TestTwoClocksShareOneLimit reports.
type skewReport struct {
	WallUnixMs int64          // time.Now() as this process sees it
	Allowed    map[string]int // per algorithm: Allows admitted
	Admissions []int64        // Redis TIME (µs) just after each admitted Wait
	Errors     []string       // anything that went wrong
}

// skewExactRules are "100 per year, burst 100" in every algorithm: nothing
// refills during the test, so two processes sharing the limit are admitted
// exactly 100 times between them, and twice that if they did not share it.
func skewExactRules() []throttle.Rule {
	year := 365 * 24 * time.Hour
	var rules []throttle.Rule
	for _, a := range []throttle.Algorithm{throttle.FixedWindow, throttle.SlidingLog, throttle.SlidingWindow, throttle.TokenBucket, throttle.GCRA} {
		rules = append(rules, throttle.Rule{Name: string(a), Algorithm: a, Limit: throttle.Limit{Count: 100, Period: year, Burst: 100}})
	}
	return rules
}

// skewPacedRule paces Waits at 20/s, burst 1.
var skewPacedRule = throttle.Rule{Name: "paced", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(1)}

const skewWaitFor = 2 * time.Second

// runSkewWorkload is what each process does: for each exact rule, 4
// goroutines Allow 60 times each (240 attempts for 100 permits); then 4
// goroutines Wait on the paced rule for skewWaitFor, recording the slot
// each was granted on Redis's clock.
func runSkewWorkload(addr, prefix string) skewReport {
	rep := skewReport{WallUnixMs: time.Now().UnixMilli(), Allowed: map[string]int{}}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	ctx := context.Background()
	var mu sync.Mutex
	fail := func(err error) {
		mu.Lock()
		rep.Errors = append(rep.Errors, err.Error())
		mu.Unlock()
	}
	// Start together: each process counts itself in, then waits for both.
	barrier := prefix + "barrier"
	if err := rdb.Incr(ctx, barrier).Err(); err != nil {
		fail(err)
		return rep
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		if n, _ := rdb.Get(ctx, barrier).Int(); n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			fail(fmt.Errorf("the other process did not start within a minute"))
			return rep
		}
	}
	for _, rule := range skewExactRules() {
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, rule)
		if err != nil {
			fail(err)
			continue
		}
		var n atomic.Int32
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				for range 60 {
					res, err := lim.Allow(ctx, "shared")
					if err != nil {
						fail(err)
						return
					}
					if res.Allowed {
						n.Add(1)
					}
				}
			})
		}
		wg.Wait()
		rep.Allowed[rule.Name] = int(n.Load())
	}
	lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, skewPacedRule)
	if err != nil {
		fail(err)
		return rep
	}
	// This process's clock against Redis's, to half a round trip, to put
	// every granted slot on Redis's clock.
	t0 := time.Now()
	rt, err := rdb.Time(ctx).Result()
	if err != nil {
		fail(err)
		return rep
	}
	offset := rt.Sub(t0.Add(time.Since(t0) / 2))
	end := time.Now().Add(skewWaitFor)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				// Wait, with the slot it was granted recorded: Reserve
				// under the same deadline, then sleep until the slot.
				wctx, cancel := context.WithDeadline(ctx, end)
				r, err := lim.ReserveN(wctx, "paced", 1)
				cancel()
				if err != nil {
					return // the deadline: the slot would come after end
				}
				mu.Lock()
				rep.Admissions = append(rep.Admissions, time.Now().Add(r.Delay()).Add(offset).UnixMicro())
				mu.Unlock()
				time.Sleep(time.Until(time.Now().Add(r.Delay())))
			}
		})
	}
	wg.Wait()
	return rep
}

// TestTwoClocksShareOneLimit runs the same workload in this process and in
// a child process (this test binary, re-executed) started under
// `faketime -f +10m` when faketime is installed, against one redis-server.
// They must share every limit exactly: 100 admissions in total per "100
// per year" rule, whatever the algorithm, and the paced GCRA rule's
// admissions from both processes, on Redis's clock, never more than
// 20 + 1 in any 1s window.
//
// faketime moves the clock of programs that read it through libc. The Go
// runtime reads the kernel's vDSO directly, so faketime does not move a Go
// program's time.Now (the child reports what it sees; the test logs it).
// What proves that client clocks do not matter is therefore
// TestNoClientClockInScripts (no client timestamp reaches any decision)
// together with this test (two processes, one exact limit).
func TestTwoClocksShareOneLimit(t *testing.T) {
	if child() == roleSkewed {
		rep := runSkewWorkload(os.Getenv("JT_REDIS_ADDR"), os.Getenv("JT_PREFIX"))
		out, _ := json.Marshal(rep)
		fmt.Printf("\nREPORT %s\n", out)
		return
	}
	if child() != "" {
		t.Skip("child process of another test")
	}
	srv := redistest.Server(t)
	prefix := redistest.Prefix(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd, out := childCommand(t, ctx, "TestTwoClocksShareOneLimit", roleSkewed, "JT_REDIS_ADDR="+srv.Addr(), "JT_PREFIX="+prefix)
	faked := false
	if ft, err := exec.LookPath("faketime"); err == nil {
		cmd.Args = append([]string{ft, "-f", "+10m"}, cmd.Args...)
		cmd.Path = ft
		faked = true
	} else {
		t.Logf("faketime is not installed; the child runs with this machine's clock")
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	local := runSkewWorkload(srv.Addr(), prefix)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	var remote skewReport
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	found := false
	for sc.Scan() {
		if js, ok := strings.CutPrefix(sc.Text(), "REPORT "); ok {
			if err := json.Unmarshal([]byte(js), &remote); err != nil {
				t.Fatalf("child report: %v", err)
			}
			found = true
		}
	}
	if !found {
		t.Fatalf("child printed no report:\n%s", out)
	}
	for _, e := range append(local.Errors, remote.Errors...) {
		t.Errorf("workload error: %s", e)
	}
	skew := time.Duration(remote.WallUnixMs-local.WallUnixMs) * time.Millisecond
	t.Logf("child under faketime=%v: its time.Now is %v ahead of ours (Go ignores faketime: it reads the vDSO, not libc)", faked, skew.Round(10*time.Millisecond))

	for _, rule := range skewExactRules() {
		l, r := local.Allowed[rule.Name], remote.Allowed[rule.Name]
		if l+r != 100 {
			t.Errorf("%s: %d + %d admitted by the two processes; want exactly 100 between them", rule.Name, l, r)
		}
		t.Logf("%s: %d + %d = %d admitted (100 per year shared)", rule.Name, l, r, l+r)
	}
	all := slices.Concat(local.Admissions, remote.Admissions)
	slices.Sort(all)
	worst := 0
	for i := range all {
		j, _ := slices.BinarySearch(all, all[i]+int64(time.Second/time.Microsecond))
		worst = max(worst, j-i)
	}
	t.Logf("paced rule: %d + %d slots granted; most in any 1s window (Redis clock): %d (limit 20/s, burst 1)", len(local.Admissions), len(remote.Admissions), worst)
	// 20 per second plus the burst; one more because each process puts
	// its slots on Redis's clock to within half a round trip.
	if worst > 20+1+1 {
		for i := 1; i < len(all); i++ {
			t.Logf("gap %d: %v", i, time.Duration(all[i]-all[i-1])*time.Microsecond)
		}
		t.Errorf("%d slots granted in one second; want at most 22", worst)
	}
	if len(remote.Admissions) == 0 || len(local.Admissions) == 0 {
		t.Errorf("one process was never admitted (%d, %d): the limit was not shared", len(local.Admissions), len(remote.Admissions))
	}
}
