// Package worker is the asynq adapter of jobthrottle's shared limits: a
// middleware that maps each task to its rule (TaskRule), subject, cost and
// ID, asks the rule's admission.Gate, and maps the answer back to asynq:
// run the handler, or park the task until its booked turn (an
// *admission.ThrottledError that Configure reschedules without counting a
// failure or using up a retry, plus a wake-up in the ledger).
//
// It owns the asynq side only: how a task maps to a request, how a parked
// task is put back in its queue (Inspector.RunTask, or a copy for a task
// with no retry left), and how a decision maps to asynq. The rules file is
// package rules; the run/wait/park decision, the wake-up ledger, the
// serving of lines and the sweeping of places are package admission
// (admission.Parking); the limits are package throttle. It must not be imported by admission,
// rules, enqueue or handler; only binaries and programs (cmd/worker,
// examples) put it together with them.
//
//	cfg, err := rules.Load("rules.yaml") // or NewMiddleware([]worker.TaskRule{…}, opts) in code
//	if err != nil {
//		return err // rules.yaml:7: rule "stripe": period: "0s" must be at least 1µs
//	}
//	mw, err := worker.FromRules(cfg, rdb, worker.Options{Metrics: metrics, Asynq: rdb})
//	if err != nil {
//		return err
//	}
//	srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{Concurrency: 20}))
//	mux := asynq.NewServeMux()
//	mux.Use(mw.Wrap)
//	mux.HandleFunc("stripe:charge", charge)
//	return srv.Run(mux)
//
// Configure sets asynq.Config.IsFailure and RetryDelayFunc to IsFailure
// and RetryDelay: a deferred task returns a *admission.ThrottledError, which asynq
// then moves to its retry set for RetryAt (rounded up to the whole second,
// asynq's resolution) without incrementing its retry count. A task whose
// subject cannot be derived (a malformed payload) is archived at once with
// the reason. When asynq ends a waiting task (shutdown), the permit is
// refunded and asynq puts the task back in its queue.
//
// Limits change live: Middleware.Reload takes the rules of a changed file
// (cmd/worker calls it on SIGHUP). It builds every new limiter first and
// changes nothing if one fails or if the change cannot apply while the old
// keys live (rules.Config.CheckChange); otherwise it swaps the rules at
// once. A limit's Redis state is keyed by prefix, subject and name only, so
// bookings made under the old limit are kept and new bookings use the new
// one; a parked backlog books no further than the rule's Horizon ahead (1s
// by default) and waits in the subject's line for the rest, so a new limit
// is in force within about a second. Tasks already admitted finish under
// the rule they started with. TaskRule.FairBy divides one limit among the
// tenants waiting in that line, and TaskRule.ShareLimit caps each tenant
// inside it (an API key's 100/s, at most 10/s a tenant): a tenant its own
// limit holds back waits in the line while the others are served.
//
// Explain says where a task is and why (cmd/worker explain): asynq's
// state of it, and what its rule's limiter and the wake-up ledger keep
// about it in Redis (its booked turn, its position in its subject's line).
//
// See README.md in this directory for the binary, the metrics and the
// parking semantics in full, and rules/README.md for the rules file.
package worker
