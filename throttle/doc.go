// Package throttle paces work against rate limits shared, through Redis,
// by every process that uses the same keys.
//
// A Limiter applies one or more rules to a subject (a tenant, an API key, a
// host). Each rule uses one of five algorithms, each an atomic Lua script
// that reads the Redis clock, so machines whose clocks disagree still share
// one limit: FixedWindow, SlidingLog, SlidingWindow (counter), TokenBucket
// and GCRA (the leaky bucket). All rules of a Limiter over one subject are
// checked and charged in one round trip, all or nothing; a rule may name
// its own subject (Rule.Subject: a global limit beside per-tenant ones),
// and the subjects are then acquired one after another, a refused request
// keeping nothing.
//
// Allow answers now. Wait blocks until the request is admitted: for
// TokenBucket and GCRA it reserves the earliest free slot in one round trip
// and sleeps until then, refunding the slot if the context ends first; for
// windows, waiters in one process queue and only the first asks Redis, at
// the moment the script says a permit frees. ReserveN books a future slot
// for any algorithm, and PrepayN books one with a receipt that a consumer
// redeems through Admit. Admit is for work that can
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
// Keys are <prefix>{<subject>}:<rule> (DefaultPrefix "jobthrottle:", the
// same default as the worker's rules file and enqueue), so all keys of a
// subject share one Redis Cluster slot; every key has a TTL no longer than
// it must remember.
//
// AllowN(ctx, subject, 0) reads a subject's state under every rule without
// charging it; AllowAtMost takes what there is, up to n; Reset forgets a
// subject; PauseFor holds every rule of a subject back until a time an
// upstream gave (package httpthrottle does this for HTTP responses).
//
// The package owns the limiter, its algorithms and their Lua scripts. It
// imports go-redis and the standard library, and nothing else of
// jobthrottle: the admission, worker and httpthrottle packages build on its
// exported API.
//
// # Exactness
//
// TokenBucket and GCRA are one algorithm, golang.org/x/time/rate's, kept
// as a GCRA timestamp, and make the same decisions. Their arithmetic is
// exact for every Limit that validates: every time is a whole number of
// microseconds plus a remainder in units of 1/Count µs, so 7 per second
// (an interval of 142857.142…µs) admits its burst at one instant and its
// next permit at 142858µs, never a rounding early or late. Delays are
// reported rounded up to the microsecond, Redis's unit. A test replays
// random sequences against x/time/rate and agrees on every decision.
//
// On one key, the admissions of the bucket algorithms, on Redis's clock,
// never exceed Burst + Count in any window of Period (GCRA's bound), however
// many processes wait: 256 waiters in 4 processes at 5000/s burst 10 admit
// at most 5009 in any second on a real server. A client's own clock can
// count a few more, from the jitter of waking up, not from admissions.
//
// # Differences from golang.org/x/time/rate and go-redis/redis_rate
//
// Users port code and tests from these two libraries. Where this package
// differs from either, the table says how; everything else matches.
//
//	behaviour             x/time/rate                      redis_rate                    throttle
//	--------------------  -------------------------------  ----------------------------  -------------------------------------------
//	clock                 the caller's (AllowN(t, n))      Redis TIME                    Redis TIME; waking maps it to local time
//	arithmetic            float64 tokens, ns; a deficit    float64 µs in Lua             exact (see above); whole µs, delays rounded
//	                      under 1ns admits                                               up; a request 1µs early is denied
//	rate                  Limit (events/s), Inf allowed    Limit{Rate, Burst, Period}    Limit{Count, Period, Burst}; no Inf; burst ≥ 1
//	n > burst             AllowN false, WaitN error        denied                        ErrExceedsCapacity, for every method
//	n = 0                 AllowN(0): true unless in debt;  AllowN(0) reads the state     AllowN(0): x/time/rate's Allowed and
//	                      ReserveN/WaitN(0) wait out the   (Allowed 0)                   RetryAfter, redis_rate's Remaining and
//	                      debt; moves lastEvent                                          ResetAfter; charges and changes nothing
//	Allowed               bool                             int (permits granted)         bool; AllowAtMost returns the count
//	Remaining on denial   (Tokens)                         0                             whole permits available now
//	RetryAfter if allowed —                                -1                            0
//	AllowAtMost           —                                grants ≥ 1 or denies          the same; n capped at the burst/count
//	Reset                 —                                deletes the key               deletes every rule's keys and the pause
//	Reservation.Delay     time left from now               —                             the same, from the slot on the local clock
//	Cancel                after the time to act: nothing;  —                             the same, decided on Redis's clock; and a
//	                      before: n less what later                                      place held by later reservations comes
//	                      reservations took                                              back when those are cancelled too (x/time/
//	                                                                                     rate keeps it); a refusal by another
//	                                                                                     subject's rules gives back even after
//	                                                                                     the time to act
//	Wait                  fails at once past the deadline  — (loop Allow, sleep)         the same; also Options.MaxWait; windows
//	                                                                                     queue locally; *DelayError says when
//	limit changes         SetLimit, SetBurst               per call                      a Limiter's rules are fixed; a new Limiter
//	                                                                                     reads the old state (rounded up)
//	algorithms            token bucket                     GCRA                          both, plus three windows
package throttle
