// Package jobthrottle paces background jobs against limits shared by every
// worker process through Redis: a job over the limit waits for its turn; it
// is not dropped, not failed, and not retried in a loop. The library is in
// package throttle; the asynq middleware, rules files and deferral are in
// package worker; cmd/worker and cmd/enqueue are the binaries. This root
// package holds only the end-to-end tests, which run real asynq servers
// against a real Redis.
package jobthrottle
