// Package worker throttles asynq tasks with jobthrottle's shared limits:
// a middleware that, per task type, waits for a permit while the wait
// fits the task's deadline and the rule's maximum wait, and otherwise
// defers the task to the exact time its permit comes, without counting a
// failure or using up a retry.
//
//	cfg, err := worker.LoadConfig("rules.yaml") // or NewMiddleware(rules) in code
//	if err != nil {
//		return err // rules.yaml:7: rule "stripe": period: "0s" must be at least 1µs
//	}
//	mw, err := cfg.Middleware(rdb, worker.WithMetrics(metrics))
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
// See README.md in this directory for the rules file, the metrics and the
// deferral semantics in full.
package worker
