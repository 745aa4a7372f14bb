package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/hibiken/asynq"
)

// newLogger is the worker's logger on w: text or JSON at level, every
// time.Duration written as Go writes it ("10s", "1.5ms") in both formats.
func newLogger(w io.Writer, level slog.Level, json bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: durationText}
	if json {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// durationText is a slog ReplaceAttr that writes a time.Duration as its
// String: the JSON handler would write nanoseconds
// ("shutdown_timeout":10000000000), which a reader must divide in their head.
func durationText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

// processLogs, if set, routes the process-wide loggers to log: main sets
// it so that go-redis's own lines (dial retries, pool notices) go to the
// same logger and --log-format json gives only JSON. go-redis has one
// logger per process, so tests, which call run in parallel, leave it nil.
var processLogs func(log *slog.Logger)

// redisLogger sends go-redis's own log lines to slog, at warn level:
// they are about connections failing and retried.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, fmt.Sprintf(format, v...), "component", "go-redis")
}

// asynqLevel is the asynq log level matching a slog level.
func asynqLevel(l slog.Level) asynq.LogLevel {
	switch {
	case l <= slog.LevelDebug:
		return asynq.DebugLevel
	case l <= slog.LevelInfo:
		return asynq.InfoLevel
	case l <= slog.LevelWarn:
		return asynq.WarnLevel
	default:
		return asynq.ErrorLevel
	}
}
