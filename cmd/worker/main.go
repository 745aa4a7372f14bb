// Command worker runs an asynq worker whose tasks are throttled by a rules
// file shared by every worker process through Redis, and run by the
// handlers the file names (http calls and commands):
//
//	export REDIS_URL=redis://:password@redis:6379/0  # not --redis: a flag shows in ps
//	worker --config rules.yaml --concurrency 20 --queues critical=6,default=3 --metrics-addr :9090
//	worker --check --config rules.yaml    # check as start does, print the rules, connect to nothing
//	worker explain --config rules.yaml TASK_ID  # where a task is and why (explain.go)
//
// Without --redis (or REDIS_URL) it starts an in-memory Redis on loopback
// and logs its address first. Without --config it uses built-in demo
// rules and handles the demo task types demo:echo and demo:api (which
// calls a local "third-party API" through httpthrottle.Transport); with
// --config, only if --demo says so. SIGINT or SIGTERM shut it down
// gracefully, and a second one stops it at once. SIGHUP reads the rules
// file again and applies its limits and handlers to the tasks that arrive
// from then on, or, if the file fails to load, logs why and keeps the
// running rules (worker/README.md, "Changing limits live"). Exit status: 0
// done, 1 a failure at run time (Redis, a port in use, a second signal), 2
// a mistake in the flags, the rules file or the environment it needs. See
// worker/README.md.
//
// It owns flags, files and wiring only: the rules file (package rules), the
// middleware (package worker), the handlers (package handler), Redis URLs
// (internal/redisurl). It must not import enqueue.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	_ "time/tzdata" // calendar quotas name IANA zones; a machine without zoneinfo still reads them

	"github.com/redis/go-redis/v9"
)

// Exit codes, as cmd/enqueue's.
const (
	exitOK    = 0
	exitError = 1 // the work failed
	exitUsage = 2 // a mistake in the flags, the rules file or the environment it needs
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "explain" {
		// Its one line of error says what failed; go-redis's dial retries
		// would only repeat it.
		redis.SetLogger(redisLogger{slog.New(slog.DiscardHandler)})
		err := explain(context.Background(), os.Args[2:], os.Getenv, os.Stdout, os.Stderr)
		os.Exit(explainExitCode(os.Stderr, err))
	}
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	processLogs = func(log *slog.Logger) { redis.SetLogger(redisLogger{log}) }
	err := run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr, signals)
	os.Exit(exitCode(os.Stderr, err))
}

// usageError is a mistake in the flags, the rules file or the
// environment it needs: exit 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// exitCode prints err, if any, as "worker: <message>" (without the
// package prefix the message may already carry) and returns the exit
// status for it.
func exitCode(w io.Writer, err error) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	var ue usageError
	if errors.As(err, &ue) && ue.err == errFlagParse {
		return exitUsage // the flag package has printed the message and usage
	}
	if errors.Is(err, errStoppedAtOnce) {
		return exitError // the log has said so
	}
	msg := err.Error()
	for changed := true; changed; {
		changed = false
		for _, p := range []string{"worker: ", "handler: ", "throttle: "} {
			if s, ok := strings.CutPrefix(msg, p); ok {
				msg, changed = s, true
			}
		}
	}
	fmt.Fprintln(w, "worker:", msg)
	if errors.As(err, &ue) {
		return exitUsage
	}
	return exitError
}

// errFlagParse stands for an error the flag package has already printed.
var errFlagParse = errors.New("bad flags")
