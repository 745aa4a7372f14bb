// Command enqueue puts batches of asynq tasks in their queues, paced in the
// same Redis ledger the workers' throttle rules use, once or on cron
// schedules. See README.md.
//
// It owns flags and files only (thin, as cmd/worker): it reads --redis with
// internal/redisurl, the rules file with package rules, and hands off to
// package enqueue. It must not import worker or handler.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
	_ "time/tzdata" // calendar quotas name IANA zones; a machine without zoneinfo still reads them
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}
