package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redisurl"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/worker"
)

// worker explain: where a task is and why (worker.Explain), for an
// operator whose task does not run.

// exitNotFound is explain's exit status when no queue holds the task.
const exitNotFound = 3

const explainUsage = `usage: worker explain [--redis URL] [--config rules.yaml] [--queue Q] [--json] TASK_ID

Says where the task is and why: running, pending, parked by a rule for a
subject until its booked turn or in its subject's line, scheduled, waiting
for a retry, archived or completed; and what it last waited for. It
changes nothing. Exit status: 0 found, 1 Redis failed, 2 a mistake in the flags or
the rules file, 3 no such task.

`

// explainTimeout bounds explain's Redis calls together.
const explainTimeout = 30 * time.Second

// explainOptions are explain's command line settings.
type explainOptions struct {
	redisURL, config, queue string
	json                    bool
	id                      string
	wakeupShards            int
}

// parseExplainFlags reads explain's flags, before or after the task ID,
// falling back to the environment for the Redis URL and the rules file as
// the worker does. Its errors are mistakes of usage.
func parseExplainFlags(args []string, getenv func(string) string, out io.Writer) (explainOptions, error) {
	var o explainOptions
	fs := flag.NewFlagSet("worker explain", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(out, explainUsage)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL of the fleet (asynq and the limits), else $REDIS_URL (prefer it: a flag shows in ps)")
	fs.StringVar(&o.config, "config", "", "the workers' rules file, else $JOBTHROTTLE_CONFIG: without it, the task's rule and its booking are unknown")
	fs.StringVar(&o.queue, "queue", "", "the task's queue (default: look in every queue)")
	fs.IntVar(&o.wakeupShards, "wakeup-shards", admission.DefaultWakeupShards, "the workers' --wakeup-shards, to find the task's wake-up")
	fs.BoolVar(&o.json, "json", false, "print the explanation as JSON (worker.Explanation; see worker/README.md)")
	var ids []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return o, err
			}
			return o, usageError{errFlagParse}
		}
		if fs.NArg() == 0 {
			break
		}
		ids, args = append(ids, fs.Arg(0)), fs.Args()[1:]
	}
	switch {
	case len(ids) == 0:
		return o, usageError{errors.New("explain: which task? Give its ID: worker explain [flags] TASK_ID")}
	case len(ids) > 1:
		return o, usageError{fmt.Errorf("explain: one task ID at a time, not %d", len(ids))}
	}
	o.id = ids[0]
	if o.redisURL == "" {
		o.redisURL = getenv("REDIS_URL")
	}
	if o.config == "" {
		o.config = getenv("JOBTHROTTLE_CONFIG")
	}
	if o.redisURL == "" {
		return o, usageError{errors.New("explain: no Redis: set REDIS_URL (or --redis) to the fleet's Redis")}
	}
	return o, nil
}

// explain runs worker explain with args (those after "explain"), printing
// the explanation to stdout.
func explain(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	o, err := parseExplainFlags(args, getenv, stderr)
	if err != nil {
		return err
	}
	var cfg *rules.Config
	if o.config != "" {
		if cfg, _, err = loadRules(o.config); err != nil {
			return err
		}
	}
	rdb, err := redisurl.Open(o.redisURL)
	if err != nil {
		return usageError{err}
	}
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, explainTimeout)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return redisFailure("Redis at "+redisurl.Redact(o.redisURL), err)
	}
	e, err := worker.Explain(ctx, rdb, o.id, worker.ExplainOptions{Queue: o.queue, Rules: cfg, WakeupShards: o.wakeupShards})
	switch {
	case errors.Is(err, worker.ErrAmbiguousTask):
		return usageError{fmt.Errorf("%w (--queue)", err)}
	case err != nil:
		return err
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(e)
	}
	_, err = io.WriteString(stdout, e.Text())
	return err
}

// explainExitCode prints err as exitCode does and returns explain's exit
// status for it: exitCode's, or exitNotFound.
func explainExitCode(w io.Writer, err error) int {
	code := exitCode(w, err)
	var nf *worker.TaskNotFoundError
	if errors.As(err, &nf) {
		return exitNotFound
	}
	return code
}
