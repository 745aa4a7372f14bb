// Package jobthrottle paces background jobs against limits shared by every
// worker process through Redis: a job over the limit waits for its turn; it
// is not dropped, not failed, and not retried in a loop. The limits are
// package throttle; the run/wait/park decision and the wake-up ledger are
// package admission; the rules file is package rules; the asynq middleware
// is package worker; producers are package enqueue; cmd/worker and
// cmd/enqueue are the binaries (README.md, "Layout", has the import graph).
// This root package holds only the end-to-end tests, which run real asynq
// servers against a real Redis.
package jobthrottle
