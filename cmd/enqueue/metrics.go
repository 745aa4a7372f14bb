package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/jobthrottle/jobthrottle/enqueue"
)

// firingMetrics counts the schedules' firings by outcome, for
// --metrics-addr and the exit status of a --run-for run.
type firingMetrics struct {
	reg     *prometheus.Registry
	firings *prometheus.CounterVec
	tasks   *prometheus.CounterVec
	n, bad  atomic.Int64
}

func newFiringMetrics() *firingMetrics {
	m := &firingMetrics{
		reg: prometheus.NewRegistry(),
		firings: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "jobthrottle_schedule_firings_total",
			Help: "Firings of each schedule by outcome: enqueued (the whole batch) or failed (the batch stopped at a task that could not be enqueued).",
		}, []string{"schedule", "outcome"}),
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "jobthrottle_schedule_tasks_enqueued_total",
			Help: "Tasks enqueued by each schedule.",
		}, []string{"schedule"}),
	}
	m.reg.MustRegister(m.firings, m.tasks)
	return m
}

// onBatch is enqueue.SchedulerOptions.OnBatch.
func (m *firingMetrics) onBatch(schedule string, res enqueue.Summary, err error) {
	m.n.Add(1)
	outcome := "enqueued"
	if err != nil {
		m.bad.Add(1)
		outcome = "failed"
	}
	m.firings.WithLabelValues(schedule, outcome).Inc()
	m.tasks.WithLabelValues(schedule).Add(float64(res.Enqueued))
}

func (m *firingMetrics) total() int64  { return m.n.Load() }
func (m *firingMetrics) failed() int64 { return m.bad.Load() }

// serve serves /metrics on addr until stop is called.
func (m *firingMetrics) serve(addr string, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("enqueue: metrics server failed", "error", err)
		}
	}()
	log.Info("enqueue: serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}
