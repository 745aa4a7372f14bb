package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// readyTimeout bounds one /readyz check: a probe (Kubernetes waits 1 s by
// default) gets its answer in time even when Redis hangs. A Redis that
// answers takes well under a millisecond.
const readyTimeout = 500 * time.Millisecond

// healthMux serves /metrics, /healthz (the process is up), /readyz
// (ready answers nil: Redis answers and the throttle scripts run) and,
// if status is not nil, the status page at / and /status.
func healthMux(reg *prometheus.Registry, ready func(context.Context) error, status http.Handler) http.Handler {
	mux := http.NewServeMux()
	if status != nil {
		mux.Handle("GET /{$}", status)
		mux.Handle("GET /status", status)
	}
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := ready(r.Context()); err != nil {
			// The error names no password: connect() checked the URL.
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// serveMetrics serves healthMux on addr until stop is called. An address
// it cannot listen on (in use, say) is a failure at run time.
func serveMetrics(addr string, reg *prometheus.Registry, ready func(context.Context) error, status http.Handler, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics-addr: %w", err)
	}
	srv := &http.Server{Handler: healthMux(reg, ready, status), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("worker: metrics server failed", "error", err)
		}
	}()
	base := "http://" + ln.Addr().String()
	log.Info("worker: serving metrics", "url", base+"/metrics", "healthz", base+"/healthz", "readyz", base+"/readyz", "status", base+"/status")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

// readiness returns the /readyz check: Redis answers PING, and a throttle
// script runs under the rules' prefix (go-redis loads it if Redis has
// lost it, say after a restart). It answers within readyTimeout whatever
// Redis does: go-redis bounds a read by its own read timeout (3 s by
// default), not by the context, so the check runs aside and is given up
// on when the time is over (it ends at go-redis's timeout).
func readiness(rdb redis.UniversalClient, cfg *rules.Config) (func(context.Context) error, error) {
	lim, err := cfg.Limiter(rdb, cfg.Rules[0].Name, throttle.Options{})
	if err != nil {
		return nil, err
	}
	check := func(ctx context.Context) error {
		if err := rdb.Ping(ctx).Err(); err != nil {
			return redisFailure("Redis", err)
		}
		if _, err := lim.PauseFor(ctx, "readyz", 0); err != nil {
			return fmt.Errorf("the throttle scripts do not run: %v", err)
		}
		return nil
	}
	return func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, readyTimeout)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- check(ctx) }()
		select {
		case err := <-done:
			return err
		case <-ctx.Done():
			return fmt.Errorf("Redis does not answer within %v", readyTimeout)
		}
	}, nil
}

// redisFailure is the error for a Redis (at, such as "Redis at
// redis://…") that failed: one that answered with an error (WRONGPASS,
// LOADING…) says so, as one that did not answer does.
func redisFailure(at string, err error) error {
	var answer redis.Error
	if errors.As(err, &answer) {
		return fmt.Errorf("%s answered with an error: %v", at, err)
	}
	return fmt.Errorf("%s does not answer: %v", at, err)
}
