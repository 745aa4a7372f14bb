package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The learn part through the built binaries (-learn-workers): issue 19 as
// a user meets it. cmd/worker is built into a temporary directory; each
// case starts 3 or 10 worker processes on one redis-server with a rules
// file whose rule (GCRA, cfg.Configured a second, burst 1) is well above
// the fake API's limit (learnapi.go, which the workers are not told) and
// whose http handler calls that API; cfg.Tasks tasks are enqueued through
// asynq, and half way through, in half the cases, Redis is stalled by
// CLIENT PAUSE. Figures come from the API's own log (learnreport.go), the
// workers' /metrics (parks, decisions) and Redis's MONITOR stream (the
// limiter's script calls: EVALSHA/EVAL on jobthrottle's keys).

// workerRun is one case's figures: the API's (learnRun) and the fleet's.
type workerRun struct {
	*learnRun
	// Tasks enqueued; Completed, Archived and Retry are asynq's counts
	// at the end (a task parked by a rule is neither failed nor retried).
	Tasks     int `json:"tasks"`
	Completed int `json:"completed"`
	Archived  int `json:"archived"`
	Retry     int `json:"retry"`
	// AcceptedTwice is the tasks the API accepted more than once;
	// NeverAccepted those it never accepted.
	AcceptedTwice int `json:"accepted_twice"`
	NeverAccepted int `json:"never_accepted"`
	// Decisions are the workers' jobthrottle_decisions_total for the rule
	// (one an admission), Attempts their jobthrottle_handler_attempts_total,
	// by outcome, summed. ParksPerTask is the times a task left its worker
	// to come back later (parked or deferred by the rule, throttled by the
	// handler: a 429, a departure too far, a pause) ÷ Tasks.
	Decisions        map[string]int `json:"decisions"`
	Attempts         map[string]int `json:"handler_attempts"`
	DecisionsPerTask float64        `json:"decisions_per_task"`
	ParksPerTask     float64        `json:"parks_per_task"`
	// LimiterCallsPerTask is the script calls the workers sent (admit,
	// departures, learning, pauses, wake-ups) ÷ Tasks; OtherCallsPerTask
	// the other commands they sent on jobthrottle's keys (the published
	// limits). Both are the workers' jobthrottle_redis_calls_total (split);
	// results of a library before 4d0d261 counted them from MONITOR, whose
	// other commands also held the scripts' own calls.
	LimiterCalls        int64            `json:"limiter_calls"`
	LimiterCallKinds    map[string]int64 `json:"limiter_call_kinds"` // by kind and call (jobthrottle_redis_calls_total); before 4d0d261 by SHA, key count, first key, from MONITOR`
	LimiterCallsPerTask float64          `json:"limiter_calls_per_task"`
	OtherCallsPerTask   float64          `json:"other_calls_per_task"`
	// DecisionCallsPerTask is the script calls of the decisions alone per
	// task: on the rule's key (admit, one per decision) and on the
	// upstream hash (departures, learning); PauseCallsPerTask the pause
	// checks (a task that waited for its turn asks before it sends: since
	// branch share, Upstream.Leave, which reads the pause) and pauses.
	// The rest of LimiterCalls is the worker's wake-up ledger.
	DecisionCallsPerTask float64 `json:"decision_calls_per_task"`
	PauseCallsPerTask    float64 `json:"pause_calls_per_task"`
}

// workerResult is the part's JSON: results/<date>-learn-workers.json.
type workerResult struct {
	partHead
	Config   learnConfig  `json:"config"`
	Procs    int          `json:"concurrency_per_worker"`
	RuntimeS float64      `json:"runtime_s"`
	Runs     []*workerRun `json:"runs"`
}

// workerConcurrency is each worker process's --concurrency.
const workerConcurrency = 4

// runWorkerLearnPart builds cmd/worker and runs every case (only, if set,
// picks them by name) on one throwaway redis-server.
func runWorkerLearnPart(logf func(string, ...any), cfg learnConfig, only, name string) error {
	t0 := time.Now()
	filter, err := compileFilter(only)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "jobthrottle-bench-workers-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "worker")
	build := exec.Command("go", "build", "-o", bin, "./cmd/worker")
	build.Dir, build.Stdout, build.Stderr = "..", os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("building cmd/worker: %w", err)
	}
	head, srv, err := startPart(logf, t0)
	if err != nil {
		return err
	}
	defer srv.Stop()
	cfg.Nice = niceness
	res := &workerResult{partHead: head, Config: cfg, Procs: workerConcurrency}
	for _, c := range learnCases(cfg, filter) {
		logf("learn-workers: %s", c)
		r, err := runWorkerCase(srv.Addr, bin, dir, cfg, c)
		if err != nil {
			return err
		}
		logf("learn-workers: %s; parks/task %.2f, decision calls/task %.2f (all limiter calls %.2f), completed %d/%d, archived %d",
			r.summary(), r.ParksPerTask, r.DecisionCallsPerTask, r.LimiterCallsPerTask, r.Completed, r.Tasks, r.Archived)
		res.Runs = append(res.Runs, r)
	}
	res.Machine.LoadEnd = loadavg()
	res.RuntimeS = time.Since(t0).Seconds()
	return writePart(logf, t0, name, res)
}

func compileFilter(only string) (*regexp.Regexp, error) {
	if only == "" {
		return nil, nil
	}
	return regexp.Compile(only)
}

// runWorkerCase runs one case on a flushed Redis: the API, the workers,
// the backlog, the stall; then reads every count.
func runWorkerCase(addr, bin, dir string, cfg learnConfig, c learnCase) (*workerRun, error) {
	admin := redis.NewClient(&redis.Options{Addr: addr})
	defer admin.Close()
	ctx := context.Background()
	if err := admin.FlushAll(ctx).Err(); err != nil {
		return nil, err
	}
	api := &pathAPI{limitedAPI: newLimitedAPI(cfg.Limit, c.Style), accepted: map[string]int{}}
	hs := httptest.NewServer(api)
	defer hs.Close()
	rules := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(rules, []byte(workerRules(cfg, c.Style, hs.URL)), 0o600); err != nil {
		return nil, err
	}
	if dir := os.Getenv("BENCH_LEARN_TRACE"); dir != "" {
		// A reduced run's log, for reading where the turns and departures
		// go: the API's answers and, unless BENCH_LEARN_NO_MONITOR is set
		// (the API's arrivals as an unwatched run has them), the limiter's
		// script calls.
		name := filepath.Join(dir, strings.NewReplacer(", ", "-", " ", "").Replace(c.String()))
		af, err := os.Create(name + ".api")
		if err != nil {
			return nil, err
		}
		defer af.Close()
		api.trace = af
		if os.Getenv("BENCH_LEARN_NO_MONITOR") == "" {
			mf, err := os.Create(name + ".monitor")
			if err != nil {
				return nil, err
			}
			defer mf.Close()
			mon, err := startTraceMonitor(ctx, addr, mf)
			if err != nil {
				return nil, err
			}
			defer mon.stop()
		}
	}
	procs, err := startWorkers(bin, rules, addr, c.Workers)
	defer stopWorkers(procs)
	if err != nil {
		return nil, err
	}
	cli := asynq.NewClientFromRedisClient(admin)
	for i := range cfg.Tasks {
		info, err := cli.Enqueue(asynq.NewTask("learn:call", []byte(`{"n": `+strconv.Itoa(i)+`}`)), asynq.MaxRetry(3), asynq.Retention(time.Hour))
		if err != nil {
			return nil, err
		}
		if api.trace != nil {
			api.mu.Lock()
			fmt.Fprintf(api.trace, "# task %d %s\n", i, info.ID)
			api.mu.Unlock()
		}
	}
	capD := time.Duration(cfg.CapFactor*float64(cfg.Tasks)/float64(cfg.Limit)*float64(time.Second)) + 20*time.Second
	cctx, cancel := context.WithTimeout(ctx, capD)
	defer cancel()
	stallAt := time.Duration(-1)
	if c.Stall {
		stallAt = stallHalfWay(cctx, addr, api.limitedAPI, api.n.Load, cfg)
	}
	insp := asynq.NewInspectorFromRedisClient(admin)
	info := waitCompleted(cctx, insp, cfg.Tasks)
	r := &workerRun{learnRun: analyseLearn(api.log(), cfg, c, stallAt), Tasks: cfg.Tasks}
	if info != nil {
		r.Completed, r.Archived, r.Retry = info.Completed, info.Archived, info.Retry
	}
	r.Done = r.Completed
	var calls map[string]int64
	if r.Decisions, r.Attempts, calls, err = scrapeOutcomes(procs); err != nil {
		return nil, err
	}
	r.ParksPerTask = float64(r.Decisions["parked"]+r.Decisions["deferred"]+r.Attempts["throttled"]) / float64(cfg.Tasks)
	for _, n := range r.Decisions {
		r.DecisionsPerTask += float64(n) / float64(cfg.Tasks)
	}
	r.LimiterCallKinds = calls
	r.split(calls)
	r.AcceptedTwice, r.NeverAccepted = api.answeredOnce(cfg.Tasks)

	return r, nil
}

// workerRules is the case's rules file: one rule well above the API's
// limit (at it for rule-only), one http handler calling the API.
func workerRules(cfg learnConfig, style, url string) string {
	rate := cfg.Configured
	if style == styleRuleOnly {
		rate = cfg.Limit
	}
	return fmt.Sprintf(`rules:
  - {name: partner, tasks: ["learn:*"], subject: {fixed: api}, algorithm: gcra, limit: %d, period: 1s, burst: 1}
handlers:
  - {task: "learn:call", http: {method: POST, url: "%s/v1/task/{n}", timeout: 10s}}
`, rate, url)
}

// waitCompleted polls asynq until n tasks completed or ctx ends, and
// returns the queue's last counts.
func waitCompleted(ctx context.Context, insp *asynq.Inspector, n int) *asynq.QueueInfo {
	var last *asynq.QueueInfo
	for ctx.Err() == nil {
		if info, err := insp.GetQueueInfo("default"); err == nil {
			last = info
			if info.Completed+info.Archived >= n {
				return info
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return last
}

// workerProc is one running cmd/worker and its metrics URL.
type workerProc struct {
	cmd     *exec.Cmd
	metrics string
	done    chan struct{}
}

// startWorkers starts n workers and waits until each serves its metrics
// and processes tasks.
func startWorkers(bin, rules, addr string, n int) ([]*workerProc, error) {
	var procs []*workerProc
	for range n {
		cmd := exec.Command(bin, "--config", rules, "--metrics-addr", "127.0.0.1:0",
			"--concurrency", strconv.Itoa(workerConcurrency), "--shutdown-timeout", "5s")
		cmd.Env = append(os.Environ(), "REDIS_URL=redis://"+addr+"/0")
		stderr, err := cmd.StderrPipe()
		if err != nil {
			return procs, err
		}
		if err := cmd.Start(); err != nil {
			return procs, err
		}
		p := &workerProc{cmd: cmd, done: make(chan struct{})}
		procs = append(procs, p)
		url, err := readUntilReady(stderr)
		if err != nil {
			return procs, err
		}
		p.metrics = url
		go func() {
			_ = cmd.Wait()
			close(p.done)
		}()
	}
	return procs, nil
}

var metricsURL = regexp.MustCompile(`url=(http://\S+/metrics)`)

// readUntilReady reads a worker's log until it says it processes tasks,
// returning its metrics URL, then drains the rest in the background.
func readUntilReady(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	url := ""
	for sc.Scan() {
		line := sc.Text()
		if m := metricsURL.FindStringSubmatch(line); m != nil {
			url = m[1]
		}
		if strings.Contains(line, `msg="worker: processing"`) && url != "" {
			go func() { _, _ = io.Copy(io.Discard, r) }()
			return url, nil
		}
	}
	return "", fmt.Errorf("a worker stopped before it was ready (%v)", sc.Err())
}

// stopWorkers sends SIGTERM to every worker and waits for them (SIGKILL
// after 15 s).
func stopWorkers(procs []*workerProc) {
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range procs {
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
}

var (
	counterLine  = regexp.MustCompile(`^(jobthrottle_decisions_total|jobthrottle_handler_attempts_total|jobthrottle_redis_calls_total)\{([^}]*)\} ([0-9.e+]+)$`)
	outcomeLabel = regexp.MustCompile(`(?:outcome|call)="([^"]*)"`)
	kindLabel    = regexp.MustCompile(`kind="([^"]*)"`)
)

// scrapeOutcomes sums the workers' jobthrottle_decisions_total and
// jobthrottle_handler_attempts_total by outcome, and their
// jobthrottle_redis_calls_total by kind and call ("script admit",
// "command hset").
func scrapeOutcomes(procs []*workerProc) (decisions, attempts map[string]int, calls map[string]int64, err error) {
	decisions, attempts, calls = map[string]int{}, map[string]int{}, map[string]int64{}
	for _, p := range procs {
		resp, err := http.Get(p.metrics)
		if err != nil {
			return nil, nil, nil, err
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			m := counterLine.FindStringSubmatch(sc.Text())
			if m == nil {
				continue
			}
			o := outcomeLabel.FindStringSubmatch(m[2])
			v, _ := strconv.ParseFloat(m[3], 64)
			switch {
			case o == nil:
			case m[1] == "jobthrottle_decisions_total":
				decisions[o[1]] += int(v)
			case m[1] == "jobthrottle_redis_calls_total":
				if k := kindLabel.FindStringSubmatch(m[2]); k != nil {
					calls[k[1]+" "+o[1]] += int64(v)
				}
			default:
				attempts[o[1]] += int(v)
			}
		}
		_ = resp.Body.Close()
	}
	return decisions, attempts, calls, nil
}

// pathAPI is the limitedAPI that also counts, by path (one per task), the
// requests it accepted.
type pathAPI struct {
	*limitedAPI
	mu       sync.Mutex
	accepted map[string]int
	n        atomic.Int64
	trace    io.Writer // with BENCH_LEARN_TRACE: every answer, "<unix µs> <status> <path>"
}

func (a *pathAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	sw := &statusWriter{ResponseWriter: w}
	a.limitedAPI.ServeHTTP(sw, r)
	if a.trace != nil {
		a.mu.Lock()
		fmt.Fprintf(a.trace, "%d %d %s\n", time.Now().UnixMicro(), sw.status, r.URL.Path)
		a.mu.Unlock()
	}
	if sw.status == http.StatusOK {
		a.mu.Lock()
		a.accepted[r.URL.Path]++
		a.mu.Unlock()
		a.n.Add(1)
	}
}

// answeredOnce counts the tasks of 0..n-1 accepted more than once and
// never.
func (a *pathAPI) answeredOnce(n int) (twice, never int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range n {
		switch c := a.accepted["/v1/task/"+strconv.Itoa(i)]; {
		case c == 0:
			never++
		case c > 1:
			twice++
		}
	}
	return twice, never
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

// traceMonitor writes, in a traced run (BENCH_LEARN_TRACE), every line
// of Redis's MONITOR stream on jobthrottle's keys to a file. Only a traced
// run watches Redis so: MONITOR costs Redis every command again, each
// script's own calls too, and its reader a share of the cores, which
// moved the API's arrivals in the first seconds of a run (8 runs of x-unix
// at 10 workers, 300 tasks: 23 gaps between accepted requests under 51 or
// over 55 ms in the first two seconds with MONITOR, 5 without; its reader
// in a process of its own at nice 19: 37 in 16 runs, 11 without). The
// calls are counted by the workers (jobthrottle_redis_calls_total).
type traceMonitor struct {
	conn net.Conn
	done chan struct{}
}

func startTraceMonitor(ctx context.Context, addr string, trace io.Writer) (*traceMonitor, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	m := &traceMonitor{conn: conn, done: make(chan struct{})}
	_, _ = conn.Write([]byte("MONITOR\r\n"))
	go func() {
		defer close(m.done)
		rd := bufio.NewReaderSize(conn, 1<<20)
		for {
			line, err := rd.ReadString('\n')
			if err != nil {
				return
			}
			if strings.Contains(line, `"jobthrottle:`) {
				_, _ = io.WriteString(trace, line)
			}
		}
	}()
	return m, nil
}

func (m *traceMonitor) stop() {
	_ = m.conn.Close()
	<-m.done
}

// split sorts the workers' calls (scrapeOutcomes) by what they are for:
// the pause checks (a request on its turn asks whether the fleet paused,
// Upstream.Leave's upstream_leave; pause and paused), the wake-up ledger
// (wake_*), and every other script: the decisions (admit, settle, refund,
// the upstream's departures and learning, …). Commands other than
// scripts (the published limits, the status page's reads) are the other
// calls.
func (r *workerRun) split(calls map[string]int64) {
	per := func(n int64) float64 { return float64(n) / float64(r.Tasks) }
	for k, n := range calls {
		kind, call, _ := strings.Cut(k, " ")
		if kind != "script" {
			r.OtherCallsPerTask += per(n)
			continue
		}
		r.LimiterCalls += n
		switch {
		case call == "upstream_leave", call == "pause", call == "paused":
			r.PauseCallsPerTask += per(n)
		case strings.HasPrefix(call, "wake_"):
		default:
			r.DecisionCallsPerTask += per(n)
		}
	}
	r.LimiterCallsPerTask = per(r.LimiterCalls)
}
