package main

import (
	"context"
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
	mw       *worker.Middleware
	handlers *handlerSwitch
	// build makes the handlers of a rules file, the demo ones included.
	build func(*rules.Config, *handler.Config) (*asynq.ServeMux, error)
	cfg   *rules.Config // the rules in force
}

// reload re-reads the file and logs one line: at Info, what changed; at
// Error, why the file was refused (the running rules stay).
func (r *reloader) reload() {
	if r.path == "" {
		r.log.Warn("worker: SIGHUP: no --config or JOBTHROTTLE_CONFIG: the built-in demo rules have no file to reload")
		return
	}
	cfg, hs, err := loadRules(r.path)
	var mux *asynq.ServeMux
	if err == nil {
		mux, err = r.build(cfg, hs)
	}
	if err == nil {
		err = r.mw.Reload(cfg)
	}
	if err != nil {
		r.log.Error("worker: rules file not reloaded; the running rules stay", "file", r.path, "error", err)
		return
	}
	r.handlers.h.Store(mux)
	d := r.cfg.Diff(cfg)
	r.cfg = cfg
	attrs := []any{"file", r.path, "changed", d.Changed, "added", d.Added, "removed", d.Removed, "handlers", handlerNames(hs)}
	if d.FailOpen {
		attrs = append(attrs, "fail_open", cfg.FailOpen)
	}
	r.log.Info("worker: rules reloaded", attrs...)
}

// handlerSwitch runs each task on the handlers in force when it arrives:
// a reload swaps them whole, and a task already running keeps its own.
type handlerSwitch struct {
	h atomic.Pointer[asynq.ServeMux]
}

func (s *handlerSwitch) ProcessTask(ctx context.Context, t *asynq.Task) error {
	return s.h.Load().ProcessTask(ctx, t)
}
