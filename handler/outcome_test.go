package handler_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// logRecords collects JSON log lines, safe for concurrent writers.
type logRecords struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logRecords) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logRecords) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// failures returns the records of failed attempts, in order.
func (l *logRecords) failures(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if msg, _ := r["msg"].(string); strings.HasPrefix(msg, "handler: the task failed") {
			out = append(out, r)
		}
	}
	return out
}

// metricValue is the value of the counter name with labels in reg (the
// sample count for a histogram), 0 if there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, labels) {
				if h := m.GetHistogram(); h != nil {
					return float64(h.GetSampleCount())
				}
				return m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return 0
}

func matches(m *dto.Metric, labels map[string]string) bool {
	n := 0
	for _, lp := range m.GetLabel() {
		if v, ok := labels[lp.GetName()]; ok {
			if v != lp.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(labels)
}

// observedMux registers the handlers of file, observed by a fresh
// registry and a log collector.
func observedMux(t *testing.T, file string, opts handler.Options) (*asynq.ServeMux, *prometheus.Registry, *logRecords) {
	t.Helper()
	c, err := handler.ParseConfig("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	if opts.Metrics, err = handler.NewMetrics(reg); err != nil {
		t.Fatal(err)
	}
	logs := &logRecords{}
	opts.Logger = logs.logger()
	if opts.Getenv == nil {
		opts.Getenv = func(k string) string {
			if k == "PATH" {
				return os.Getenv("PATH")
			}
			return ""
		}
	}
	mux := asynq.NewServeMux()
	if err := c.Register(mux, opts); err != nil {
		t.Fatal(err)
	}
	return mux, reg, logs
}

// outcomeCase is one attempt and what its log line and counters say.
type outcomeCase struct {
	name    string
	outcome string
	level   string // of the failure line; "" for none
	attrs   map[string]any
}

// checkOutcome runs task once on mux and checks the attempt's counters
// and its failure line (JSON numbers are float64).
func checkOutcome(t *testing.T, mux *asynq.ServeMux, reg *prometheus.Registry, logs *logRecords, task *asynq.Task, kind string, c outcomeCase) {
	t.Helper()
	err := mux.ProcessTask(context.Background(), task)
	if (err == nil) != (c.outcome == handler.OutcomeSuccess) {
		t.Errorf("ProcessTask: %v", err)
	}
	labels := map[string]string{"handler": task.Type(), "kind": kind}
	if got := metricValue(t, reg, "jobthrottle_handler_duration_seconds", labels); got != 1 {
		t.Errorf("duration observations = %v, want 1", got)
	}
	for _, o := range []string{handler.OutcomeSuccess, handler.OutcomeHTTP5xx, handler.OutcomeThrottled, handler.OutcomeTimeout, handler.OutcomeExitNonzero, handler.OutcomeSignal, handler.OutcomeError} {
		want := 0.0
		if o == c.outcome {
			want = 1
		}
		labels["outcome"] = o
		if got := metricValue(t, reg, "jobthrottle_handler_attempts_total", labels); got != want {
			t.Errorf("attempts_total{outcome=%q} = %v, want %v", o, got, want)
		}
	}
	lines := logs.failures(t)
	if c.level == "" {
		if len(lines) != 0 {
			t.Errorf("failure lines %v; want none", lines)
		}
		return
	}
	if len(lines) != 1 {
		t.Fatalf("%d failure lines %v; want one", len(lines), lines)
	}
	l := lines[0]
	want := map[string]any{"level": c.level, "task_type": task.Type(), "kind": kind, "outcome": c.outcome, "retry": c.level == "WARN"}
	for k, v := range c.attrs {
		want[k] = v
	}
	for k, v := range want {
		if l[k] != v {
			t.Errorf("log %s = %v, want %v (line %v)", k, l[k], v, l)
		}
	}
	for _, k := range []string{"duration", "error"} {
		if _, ok := l[k]; !ok {
			t.Errorf("log line lacks %s: %v", k, l)
		}
	}
}

// A failing upstream: each answer (and no answer within the timeout) is
// one attempt counted by outcome and timed; each failure is one line,
// at Warn when it will be retried, at Error when it will not; a 429 is a
// deferral, counted as throttled and not logged as a failure.
func TestHTTPAttemptsObserved(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		outcomeCase
		status int // 0: never answers
	}{
		{outcomeCase{"ok", handler.OutcomeSuccess, "", nil}, 200},
		{outcomeCase{"500", handler.OutcomeHTTP5xx, "WARN", map[string]any{"status": 500.0}}, 500},
		{outcomeCase{"404", handler.OutcomeHTTP4xx, "ERROR", map[string]any{"status": 404.0}}, 404},
		{outcomeCase{"429", handler.OutcomeThrottled, "", nil}, 429},
		{outcomeCase{"hung", handler.OutcomeTimeout, "WARN", nil}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			release := make(chan struct{})
			api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if c.status == 0 {
					<-release // until the test ends: the handler's timeout ends the attempt
					return
				}
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(c.status)
				fmt.Fprint(w, "answer")
			}))
			t.Cleanup(api.Close)
			t.Cleanup(func() { close(release) }) // before Close, which waits for the handler
			mux, reg, logs := observedMux(t, fmt.Sprintf("handlers:\n  - {task: \"api:call\", http: {url: %q, timeout: 200ms}}\n", api.URL+"/v1"), handler.Options{})
			checkOutcome(t, mux, reg, logs, asynq.NewTask("api:call", []byte(`{}`)), "http", c.outcomeCase)
		})
	}
}

// A failed attempt's line says which rule limits the task type, and, on
// a real asynq server, whether asynq will retry it by the task's retries:
// a 500 with one retry left logs at Warn, the last try at Error.
func TestFailedAttemptRetries(t *testing.T) {
	t.Parallel()
	proc := redistest.Server(t)
	rdb := proc.Client(t)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "down", http.StatusInternalServerError)
	}))
	t.Cleanup(api.Close)
	file := fmt.Sprintf(`
prefix: %q
rules:
  - {name: partner, tasks: ["partner:*"], subject: {fixed: p}, algorithm: gcra, limit: 100, period: 1s}
handlers:
  - {task: "partner:call", http: {url: %q}}
`, redistest.Prefix(t), api.URL+"/v1")
	cfg, err := rules.Parse("rules.yaml", []byte(file))
	if err != nil {
		t.Fatal(err)
	}
	mux, reg, logs := observedMux(t, file, handler.Options{Rules: cfg, Redis: rdb})
	mw, err := worker.FromRules(cfg, rdb, worker.Options{Logger: slog.New(slog.DiscardHandler), Asynq: rdb})
	if err != nil {
		t.Fatal(err)
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
		Concurrency:    1,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 0 },
		Logger:         worker.AsynqLogger(slog.New(slog.DiscardHandler)),
		LogLevel:       asynq.FatalLevel,
	}))
	if err := srv.Start(mw.Wrap(mux)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Stop(); mw.Drain(); srv.Shutdown() })
	info, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask("partner:call", []byte(`{}`)), asynq.MaxRetry(1), asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if got := settle(t, asynq.NewInspectorFromRedisClient(rdb), []string{info.ID}, 30*time.Second)[info.ID]; got.State != asynq.TaskStateArchived {
		t.Errorf("task %v (%s); want archived after its retry", got.State, got.LastErr)
	}

	lines := logs.failures(t)
	if len(lines) != 2 {
		t.Fatalf("%d failure lines %v; want two, one per attempt", len(lines), lines)
	}
	for i, want := range []map[string]any{
		{"level": "WARN", "retry": true, "retried": 0.0},
		{"level": "ERROR", "retry": false, "retried": 1.0},
	} {
		// The error, which asynq keeps as the task's last, says the same.
		if note := []string{"; will retry", "; no retry left: archived"}[i]; !strings.HasSuffix(fmt.Sprint(lines[i]["error"]), note) {
			t.Errorf("attempt %d: error %q; want it to end %q", i+1, lines[i]["error"], note)
		}
		for k, v := range map[string]any{"task_id": info.ID, "rule": "partner", "outcome": "http_5xx", "status": 500.0, "max_retry": 1.0} {
			want[k] = v
		}
		for k, v := range want {
			if lines[i][k] != v {
				t.Errorf("attempt %d: log %s = %v, want %v (line %v)", i+1, k, lines[i][k], v, lines[i])
			}
		}
	}
	if got := metricValue(t, reg, "jobthrottle_handler_attempts_total", map[string]string{"handler": "partner:call", "kind": "http", "outcome": "http_5xx"}); got != 2 {
		t.Errorf("attempts_total{outcome=http_5xx} = %v, want 2", got)
	}
}
