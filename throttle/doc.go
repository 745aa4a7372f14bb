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
// # One hot key: leased permits
//
// Every permit of one key is decided by one Redis shard, so one key admits
// at most that shard's script rate (tens of thousands a second), however
// many processes share it. Options.LocalLease lifts that for a limiter of
// one TokenBucket or GCRA rule. Where this process's own demand for a
// subject is high, Allow and Wait take a run of the bucket's next k slots
// in one script call (a reservation of k permits, from the same state
// every process and the exact path use) and hand them out in this process,
// in arrival order: each permit no earlier than its slot on the Redis
// clock, and no later than δ = LocalLease after it; a slot not handed out
// by then is dropped, never handed out later.
//
// The bound on over-admission: a lease of k permits is exactly k
// successive reservations, so a permit handed out at its slot keeps the
// exact bound; one handed out up to δ late moves by at most δ, so the
// permits admitted in any window of length W were all slotted in a window
// of W + δ:
//
//	admitted in any W ≤ Burst + Rate × (W + δ)
//
// that is, at most Rate × δ beyond the exact path's Burst + Rate × W,
// however many processes lease, and whether they join, leave or die. With
// δ = 5ms that is 0.5 % of a per-second limit. The slots are placed on
// the local clock from each lease call's own round trip: Redis read its
// TIME after the call was sent and before the reply came, which brackets
// the local moment of every slot from both sides, so "not earlier" and
// "at most δ later" hold on the Redis clock, not only on this process's.
// A process that dies loses the slots it holds, at most two leases (4δ of
// the rate): an under-admission, never an over-admission.
//
// A lease is sized from the process's demand r (permits asked for over
// the last 100ms) and the rate R: the least of 2δ·R, δ·r/(1 − r/R) (what
// arrivals at r can take before a slot is δ late) and δ·√(r·R)/4 (which
// keeps processes that share the key even: their shares converge), or
// what arrives during one lease call's round trip if that is more. A lease
// of fewer than 4 permits is not taken: at a few permits a second, every
// call is one exact decision in Redis, as without LocalLease. A process
// asks for its next lease when it holds less than one (or than two round
// trips of its demand), and gives back the unused tail of its leases once
// its requests stop; the bucket takes back what no later reservation has
// followed, as for a cancelled reservation, so under contention a refund
// may give back nothing.
//
// Under a lease, Result.Remaining counts the leased permits this process
// could hand out now, and a denied Allow's RetryAfter is when its next
// leased permit is due (successive denials are told successive slots).
// ReserveN, Admit, PrepayN and AllowAtMost never lease; a limiter with
// rules over several subjects cannot lease.
// PauseFor drops the slots this process holds; other processes hand out
// the ones they hold (at most two leases each) before they see the pause.
// Processes on the same key without LocalLease are served after the
// slots the leasing ones hold.
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
