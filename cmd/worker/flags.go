package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/jobthrottle/jobthrottle/admission"
)

// options are the command line settings.
type options struct {
	redisURL        string
	config          string
	concurrency     int
	queues          map[string]int
	metricsAddr     string
	embeddedAddr    string
	shutdownTimeout time.Duration
	demo            bool // --demo, or no rules file: serve the demo task types (demo.go)
	demoAPIRate     int
	logLevel        slog.Level
	logJSON         bool
	check           bool
	wakeupShards    int
}

// parseFlags reads the flags, falling back to the environment for the
// Redis URL, the rules file and the metrics address. Environment values
// are not flag defaults, so -help never prints a password. Its errors
// are mistakes of usage.
func parseFlags(args []string, getenv func(string) string, out io.Writer) (options, error) {
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.SetOutput(out)
	var o options
	var queues, level, format string
	fs.StringVar(&o.redisURL, "redis", "", "Redis URL, else $REDIS_URL (prefer it: a flag shows in ps, with its password):\nredis://[user:password@]host:port[/db], rediss:// (TLS),\nredis-cluster://host:port,host:port or redis-sentinel://host:port,host:port/master;\nif neither is set, an in-memory Redis is started on loopback")
	fs.StringVar(&o.config, "config", "", "rules file (YAML, see worker/README.md), else $JOBTHROTTLE_CONFIG; if neither, built-in demo rules and the demo task types.\nRead again on SIGHUP: new limits apply to new bookings, a file that fails to load changes nothing")
	fs.IntVar(&o.concurrency, "concurrency", 0, "tasks processed at once (0: the number of CPUs)")
	fs.StringVar(&queues, "queues", "default=1", "queues to process and their priorities, such as critical=6,default=3")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://<addr>/metrics, with /healthz, /readyz and a status page at / beside, such as :9090, else $JOBTHROTTLE_METRICS_ADDR")
	fs.StringVar(&o.embeddedAddr, "embedded-redis-addr", "127.0.0.1:0", "where the in-memory Redis listens when no Redis URL is given")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 10*time.Second, "on SIGTERM, how long running tasks may finish before they are put back in their queues;\na second SIGTERM or SIGINT stops at once")
	fs.BoolVar(&o.demo, "demo", false, "also serve the demo task types demo:echo and demo:api, with a stand-in third-party API on loopback\n(always on without a rules file)")
	fs.IntVar(&o.demoAPIRate, "demo-api-rate", 5, "with the demo: requests per second that demo:api tasks send to the demo third-party API, across all workers")
	fs.IntVar(&o.wakeupShards, "wakeup-shards", admission.DefaultWakeupShards, "the number of keys, each in its own hash slot, the wake-up ledger of parked tasks is spread over (1 to 64);\nthe same in every worker and producer of the fleet (a worker given more still wakes the tasks of one given fewer)")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&format, "log-format", "text", "text or json")
	fs.BoolVar(&o.check, "check", false, "check the rules file and the flags as start does, print the rules and handlers as understood, and exit (0 if valid, 2 if not); connects to nothing")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, err
		}
		return o, errFlagParse
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected argument %q: every setting is a flag (see -help)", fs.Arg(0))
	}
	for _, env := range []struct {
		v    *string
		name string
	}{{&o.redisURL, "REDIS_URL"}, {&o.config, "JOBTHROTTLE_CONFIG"}, {&o.metricsAddr, "JOBTHROTTLE_METRICS_ADDR"}} {
		if *env.v == "" {
			*env.v = getenv(env.name)
		}
	}
	var err error
	if o.queues, err = parseQueues(queues); err != nil {
		return o, err
	}
	if err := o.logLevel.UnmarshalText([]byte(level)); err != nil {
		return o, fmt.Errorf("-log-level %q: use debug, info, warn or error", level)
	}
	switch format {
	case "text", "json":
		o.logJSON = format == "json"
	default:
		return o, fmt.Errorf("-log-format %q: use text or json", format)
	}
	rateSet := false
	fs.Visit(func(f *flag.Flag) { rateSet = rateSet || f.Name == "demo-api-rate" })
	o.demo = o.demo || o.config == ""
	return o, o.validate(rateSet)
}

// validate checks the settings that need no file, network or Redis.
func (o options) validate(demoRateSet bool) error {
	switch {
	case o.concurrency < 0:
		return fmt.Errorf("-concurrency %d: must be 0 (the number of CPUs) or more", o.concurrency)
	case o.shutdownTimeout <= 0:
		return fmt.Errorf("-shutdown-timeout %v: must be positive", o.shutdownTimeout)
	case o.wakeupShards < 1 || o.wakeupShards > 64:
		return fmt.Errorf("-wakeup-shards %d: must be between 1 and 64 (the fleet's number; default %d)", o.wakeupShards, admission.DefaultWakeupShards)
	case o.demoAPIRate < 1:
		return fmt.Errorf("-demo-api-rate %d: must be at least 1", o.demoAPIRate)
	case demoRateSet && !o.demo:
		return fmt.Errorf("-demo-api-rate applies to the demo task types, which a worker with a rules file serves only with -demo: add -demo, or drop -demo-api-rate")
	}
	for _, a := range []struct{ flag, addr string }{{"-metrics-addr", o.metricsAddr}, {"-embedded-redis-addr", o.embeddedAddr}} {
		if a.addr == "" {
			continue
		}
		if _, port, err := net.SplitHostPort(a.addr); err != nil || port == "" {
			return fmt.Errorf("%s %q: want host:port or :port, such as :9090 or 127.0.0.1:0", a.flag, a.addr)
		}
	}
	return nil
}

// parseQueues reads "critical=6,default=3" (a queue without "=n" has
// priority 1).
func parseQueues(s string) (map[string]int, error) {
	queues := map[string]int{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, prio, hasPrio := strings.Cut(part, "=")
		name = strings.TrimSpace(name)
		p := 1
		if hasPrio {
			var err error
			if p, err = strconv.Atoi(strings.TrimSpace(prio)); err != nil || p < 1 {
				return nil, fmt.Errorf("-queues: %q: the priority must be a whole number of at least 1, as in critical=6,default=3", part)
			}
		}
		if name == "" {
			return nil, fmt.Errorf("-queues: %q: missing queue name, as in critical=6,default=3", part)
		}
		if _, dup := queues[name]; dup {
			return nil, fmt.Errorf("-queues: queue %q is listed twice", name)
		}
		queues[name] = p
	}
	if len(queues) == 0 {
		return nil, errors.New("-queues: no queue given; use, for example, default=1")
	}
	return queues, nil
}
