// Package throttle paces work against rate limits shared, through Redis,
// by every process that uses the same keys.
//
// A Limiter applies one or more rules to a subject (a tenant, an API key, a
// host). Each rule uses one of five algorithms, each an atomic Lua script
// that reads the Redis clock, so machines whose clocks disagree still share
// one limit: FixedWindow, SlidingLog, SlidingWindow (counter), TokenBucket
// and GCRA (the leaky bucket). All rules of a Limiter are checked and
// charged in one round trip, all or nothing.
//
// Allow answers now. Wait blocks until the request is admitted: for
// TokenBucket and GCRA it reserves the earliest free slot in one round trip
// and sleeps until then, refunding the slot if the context ends first; for
// windows, waiters in one process queue and only the first asks Redis, at
// the moment the script says a permit frees. Admit is for work that can
// leave and come back (a queued job): in one round trip it redeems the
// caller's booked turn, or takes a new one, booked under the caller's ID
// if it is later than the caller can wait. Every algorithm can book ahead:
// the windows keep a ledger of future admissions in their own state.
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	lim, err := throttle.New(rdb, throttle.Options{Prefix: "myapp:"},
//		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20)},
//	)
//	if err != nil {
//		return err
//	}
//	if err := lim.Wait(ctx, "account-42"); err != nil {
//		return err // ctx ended, or the wait would pass its deadline
//	}
//	callTheAPI()
//
// Keys are <prefix>{<subject>}:<rule>, so all keys of a subject share one
// Redis Cluster slot; every key has a TTL no longer than it must remember.
package throttle
