package worker

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/hibiken/asynq"
)

// AsynqLogger adapts l to asynq.Logger, for asynq.Config.Logger, so that
// asynq's own messages share the worker's structured log (with
// component=asynq). Fatal logs at error level and exits with status 1, as
// asynq expects.
func AsynqLogger(l *slog.Logger) asynq.Logger { return asynqLogger{l.With("component", "asynq")} }

type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) log(level slog.Level, args []any) {
	a.l.Log(context.Background(), level, fmt.Sprint(args...))
}

func (a asynqLogger) Debug(args ...any) { a.log(slog.LevelDebug, args) }
func (a asynqLogger) Info(args ...any)  { a.log(slog.LevelInfo, args) }
func (a asynqLogger) Warn(args ...any)  { a.log(slog.LevelWarn, args) }
func (a asynqLogger) Error(args ...any) { a.log(slog.LevelError, args) }
func (a asynqLogger) Fatal(args ...any) { a.log(slog.LevelError, args); os.Exit(1) }
