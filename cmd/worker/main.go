// Command worker runs an asynq worker whose tasks are throttled by a rules
// file shared by every worker process through Redis:
//
//	worker --redis redis://:password@redis:6379/0 --config rules.yaml \
//	       --concurrency 20 --queues critical=6,default=3 --metrics-addr :9090
//
// Without --redis (or REDIS_URL) it starts an in-memory Redis on loopback
// and logs its address first. Without --config it uses built-in demo
// rules. It handles the demo task types demo:echo and demo:api (which
// calls a local "third-party API" through throttle.Transport). SIGINT or
// SIGTERM shut it down gracefully. See worker/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "worker:", err)
		os.Exit(1)
	}
}
