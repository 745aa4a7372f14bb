package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The demo task types this binary handles.
const (
	// TypeEcho logs its message and returns it as the task's result.
	// Payload: {"tenant": "acme", "message": "hello"}.
	TypeEcho = "demo:echo"
	// TypeAPI fetches an account from the demo third-party API through a
	// httpthrottle.Transport shared by every worker. Payload:
	// {"account_id": "acct_42"}.
	TypeAPI = "demo:api"
)

// demo holds the demo handlers and the stand-in third-party API. A
// worker has it with --demo, or without a rules file (the quickstart);
// a worker with a rules file has neither the handlers nor the listener.
type demo struct {
	api    *http.Server // nil until listen
	apiURL string
	rate   int
	client *http.Client
	log    *slog.Logger
}

// newDemo returns the demo with the HTTP client that demo:api tasks use:
// a httpthrottle.Transport pacing all workers' requests to rate per
// second, under prefix. It listens nowhere yet: see listen.
func newDemo(rdb redis.UniversalClient, prefix string, rate int, log *slog.Logger) (*demo, error) {
	lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix, Logger: log},
		throttle.Rule{Name: "demo-api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(rate)})
	if err != nil {
		return nil, err
	}
	tr, err := httpthrottle.New(lim, httpthrottle.Options{
		OnPause: func(subject string, d time.Duration, err error) {
			log.Warn("demo: the API asked us to slow down; every worker pauses", "host", subject, "pause", d, "error", err)
		},
	})
	if err != nil {
		return nil, err
	}
	return &demo{rate: rate, client: &http.Client{Transport: tr, Timeout: time.Minute}, log: log}, nil
}

// listen starts the stand-in third-party API on loopback, until close.
func (d *demo) listen() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("demo API: %w", err)
	}
	// The stand-in API allows twice our rate, and answers 429 with
	// Retry-After beyond that, as real ones do.
	d.api = &http.Server{Handler: fakeAPI(2 * d.rate), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = d.api.Serve(ln) }()
	d.apiURL = "http://" + ln.Addr().String()
	d.log.Info("demo: third-party API stand-in listening", "url", d.apiURL, "client_rate_per_second", d.rate)
	return nil
}

func (d *demo) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = d.api.Shutdown(ctx)
}

// register adds the demo task types that the rules file's handlers do
// not run.
func (d *demo) register(mux *asynq.ServeMux, handlers *handler.Config) {
	for typ, f := range map[string]asynq.HandlerFunc{TypeEcho: d.echo, TypeAPI: d.callAPI} {
		if _, ok := handlers.Handler(typ); !ok {
			mux.Handle(typ, f)
		}
	}
}

func (d *demo) echo(ctx context.Context, t *asynq.Task) error {
	var p struct {
		Tenant  tenantID `json:"tenant"`
		Message string   `json:"message"`
	}
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		return fmt.Errorf("demo:echo: payload: %v: %w", err, asynq.SkipRetry)
	}
	w, _ := admission.WaitedFrom(ctx)
	d.log.Info("demo:echo", "tenant", p.Tenant, "message", p.Message, "waited", w.Duration.Round(time.Millisecond), "turn", w.Turn, "booked", w.Redeemed)
	return writeResult(t, map[string]any{"message": p.Message, "waited_ms": w.Duration.Milliseconds(), "turn": w.Turn, "booked": w.Redeemed})
}

func (d *demo) callAPI(ctx context.Context, t *asynq.Task) error {
	var p struct {
		AccountID string `json:"account_id"`
	}
	if err := json.Unmarshal(t.Payload(), &p); err != nil || p.AccountID == "" {
		return fmt.Errorf("demo:api: payload needs an account_id: %w", asynq.SkipRetry)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.apiURL+"/v1/accounts/"+p.AccountID, nil)
	if err != nil {
		return fmt.Errorf("demo:api: %v: %w", err, asynq.SkipRetry)
	}
	resp, err := d.client.Do(req)
	if err != nil {
		return fmt.Errorf("demo:api: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("demo:api: reading the answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		// asynq retries; the retry waits out any pause the 429 set.
		return fmt.Errorf("demo:api: the API answered %s", resp.Status)
	}
	w, _ := admission.WaitedFrom(ctx)
	d.log.Info("demo:api", "account", p.AccountID, "status", resp.StatusCode, "waited", w.Duration.Round(time.Millisecond))
	_, err = t.ResultWriter().Write(body)
	return err
}

// tenantID is demo:echo's tenant, read as the rules read subjects
// (rules.SubjectConfig.Of): a JSON string, or a number as written.
type tenantID string

func (id *tenantID) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*id = tenantID(s)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("tenant %s: want a string or a number", b)
	}
	*id = tenantID(n)
	return nil
}

func writeResult(t *asynq.Task, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if w := t.ResultWriter(); w != nil {
		_, err = w.Write(b)
	}
	return err
}

// fakeAPI is a stand-in third-party API that allows perSecond requests in
// each second and answers 429 Too Many Requests with Retry-After beyond.
func fakeAPI(perSecond int) http.Handler {
	var mu sync.Mutex
	var second int64
	var count int
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		mu.Lock()
		if s := now.Unix(); s != second {
			second, count = s, 0
		}
		count++
		over := count > perSecond
		mu.Unlock()
		if over {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "slow down", http.StatusTooManyRequests)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path": %s, "served_at": %q}`+"\n", strconv.Quote(r.URL.Path), now.UTC().Format(time.RFC3339Nano))
	})
}
