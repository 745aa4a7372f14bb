package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/handler"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// reloader applies the rules file again when the process gets SIGHUP:
// its limits (worker.Middleware.Reload) and its handlers, or, if the file
// fails to load or cannot replace the running rules, nothing at all.
type reloader struct {
	path     string // the rules file; "" for the built-in demo rules
	log      *slog.Logger
	getenv   func(string) string // the environment the process started with
	mw       *worker.Middleware
	handlers *handlerSwitch
	// build makes the handlers of a rules file, the demo ones included.
	build func(*rules.Config, *handler.Config) (*asynq.ServeMux, error)
	cfg   *rules.Config // the rules in force
	// status is told what each reload did, for the status page.
	status *status
	// quotas reads the calendar quotas of the rules in force; nil: none.
	quotas *worker.QuotaCollector
}

// reload re-reads the file and logs one line: at Info, what changed; at
// Error, why the file was refused (the running rules stay).
func (r *reloader) reload() {
	if r.path == "" {
		r.log.Warn("worker: SIGHUP: no --config or JOBTHROTTLE_CONFIG: the built-in demo rules have no file to reload")
		return
	}
	cfg, hs, err := loadRules(r.path)
	if err == nil {
		err = unsetAtReload(hs, r.getenv)
	}
	var mux *asynq.ServeMux
	if err == nil {
		mux, err = r.build(cfg, hs)
	}
	if err == nil {
		err = r.mw.Reload(cfg)
	}
	if err != nil {
		r.log.Error("worker: rules file not reloaded; the running rules stay", "file", r.path, "error", err)
		r.status.refused(err)
		return
	}
	r.handlers.h.Store(mux)
	r.status.reloaded(cfg, hs)
	if r.quotas != nil {
		if err := r.quotas.SetRules(cfg); err != nil {
			r.log.Warn("worker: the calendar quotas of the reloaded rules cannot be read; /metrics and the status page keep showing the previous rules' quotas", "error", err)
		}
	}
	d := r.cfg.Diff(cfg)
	r.cfg = cfg
	attrs := []any{"file", r.path, "changed", d.Changed, "added", d.Added, "removed", d.Removed, "handlers", handlerNames(hs)}
	if d.FailOpen {
		attrs = append(attrs, "fail_open", cfg.FailOpen)
	}
	r.log.Info("worker: rules reloaded", attrs...)
}

// unsetAtReload returns an error for the first ${VAR} of hs's handlers
// that the environment leaves unset, or nil. A reload checks it before it
// builds the handlers, whose own error would say to set the variable in
// the worker's environment: a reload cannot change that environment, a
// restart can.
func unsetAtReload(hs *handler.Config, getenv func(string) string) error {
	for _, s := range hs.Handlers {
		var values [][2]string // what, value
		if s.HTTP != nil {
			for _, h := range s.HTTP.Headers {
				values = append(values, [2]string{"header " + h.Name, h.Value})
			}
		}
		if s.Command != nil {
			for _, e := range s.Command.Env {
				values = append(values, [2]string{"env " + e.Name, e.Value})
			}
		}
		for _, v := range values {
			for _, name := range handler.EnvRefs(v[1]) {
				if getenv(name) == "" {
					return fmt.Errorf("%s:%d: handler for %q: %s: environment variable %s is not set, and a reload cannot change the environment the worker started with: set %s where the worker starts, then restart it", hs.File, s.Line, s.Task, v[0], name, name)
				}
			}
		}
	}
	return nil
}

// handlerSwitch runs each task on the handlers in force when it arrives:
// a reload swaps them whole, and a task already running keeps its own.
type handlerSwitch struct {
	h atomic.Pointer[asynq.ServeMux]
}

func (s *handlerSwitch) ProcessTask(ctx context.Context, t *asynq.Task) error {
	return s.h.Load().ProcessTask(ctx, t)
}
