// Package throttle paces work against rate limits shared, through Redis,
// by every process that uses the same keys.
//
// A Limiter applies one or more rules to a subject (a tenant, an API key, a
// host). Each rule uses one of five rate algorithms, each an atomic Lua
// script that reads the Redis clock, so machines whose clocks disagree still
// share one limit: FixedWindow, SlidingLog, SlidingWindow (counter),
// TokenBucket and GCRA (the leaky bucket); CalendarWindow, a quota reset at
// midnight in a time zone (see below); or Concurrency, at most Count
// holders at once (see below). All rules of a Limiter over one subject are
// checked and charged in one round trip, all or nothing, a turn that one
// rule holds back charged to every rule at the time it acts, not at that
// rule's own earliest; a rule may name its own subject (Rule.Subject: a
// global limit beside per-tenant ones), and the subjects are then
// acquired one after another, a refused request keeping nothing, and a
// reserved turn charged to each subject at the time it acts too.
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
// With AdmitRequest.Horizon, Admit books no turn further ahead than the
// horizon: a later caller joins the subject's line in Redis, charged
// nothing (Admission.InLine), and ServeLine serves the line, booking its
// head callers' turns as they come within the horizon and naming them in
// LineServing.Handed (or, with AdmitRequest.HeadServes, the line's head
// serves it when it comes back for its turn). So a deep backlog holds at
// most a horizon of booked turns: a rule whose limit changes (a new
// Limiter over the same rule names) is in force within a horizon, and
// callers of different
// shares (Caller.Share: tenants of one key) take turns by Weight instead of
// waiting behind whoever came first; AdmitRequest.ShareLimit also limits
// each share on its own (each tenant's 10/s inside the key's 100/s), in the
// same script. Callers of a higher Caller.Priority (levels 0 to 9) are
// served before lower ones, the shares within a level by Weight, and a
// caller that has waited AdmitRequest.MaxAge is served before every caller
// that joined after it, so that no level waits forever; a turn already
// booked is kept. Allow, Wait and ReserveN do not queue in the line; they
// take the turns the line leaves.
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	lim, err := throttle.New(rdb, throttle.Options{Prefix: "myapp:"},
//		throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20)},
//	)
//	if err != nil {
//		return err
//	}
//	defer lim.Close() // ends its goroutines
//	if err := lim.Wait(ctx, "account-42"); err != nil {
//		return err // ctx ended, or the wait would pass its deadline
//	}
//	callTheAPI()
//
// # Words
//
// Each of these words has one meaning in this package's API and docs:
//
//   - turn: a time booked for a caller to act, its slot on the Redis clock:
//     granted now or soon (Allow, Wait, ReserveN), or booked under the
//     caller's ID for later and redeemed when it comes back (Admit; a
//     receipt from PrepayN is a turn booked for a job not yet queued).
//     AdmitStatus says what became of a turn; it is not a turn itself.
//   - wait: to stay where one is until one's turn (Wait, AdmitRequest.Wait
//     and EarlyWait: how long a caller can). A caller that cannot wait
//     leaves and comes back for its booked turn.
//   - place: one of a Concurrency rule's Count places, held by one caller
//     while it runs and handed on when it frees. A caller queued for a
//     place is a waiter (Caller.Waiter); its spot in that queue, or in a
//     line, is its position, never its place.
//   - lease: how long a place is held without renewal (a Concurrency
//     rule's Period), after which a holder that died loses it; nothing
//     else. (Options.LocalLease, named before this list, hands out runs of
//     a bucket's turns in one process: see "One hot key"; it holds no
//     place.)
//   - line: a subject's queue in Redis of callers whose turn would be past
//     AdmitRequest.Horizon, charged nothing until ServeLine books their
//     turns. A Concurrency rule's queue of waiters is not a line.
//   - share: a part of a subject's line (Caller.Share, a tenant of one API
//     key), served in turn with the others by its Weight, and limited on
//     its own by AdmitRequest.ShareLimit if set. (Processes that use one
//     key have parts of its rate, not shares.)
//
// # Quotas on the calendar
//
// A CalendarWindow rule admits Limit.Count a day, a week or a month of a
// time zone (Rule.Calendar: Daily, Weekly, Monthly, or ParseCalendar of
// "day@America/Los_Angeles"), reset at midnight on the zone's wall clock:
// 23 or 25 hours on the days daylight saving starts and ends, 28 to 31
// days a month. It is decided with the policy's other rules in one call
// (1000 a day beside 20/s):
//
//	la, _ := time.LoadLocation("America/Los_Angeles")
//	lim, err := throttle.New(rdb, throttle.Options{},
//		throttle.Rule{Name: "rate", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20)},
//		throttle.Rule{Name: "daily", Algorithm: throttle.CalendarWindow, Limit: throttle.Limit{Count: 1000}, Calendar: throttle.Daily(la)},
//	)
//
// Redis TIME stays the clock. A script cannot compute a zone's midnights,
// so each call carries them: the limiter computes the window around its
// estimate of Redis TIME (the latest reply's, plus the monotonic time
// since) and the next one's end, and the script picks between the two by
// Redis TIME, so a call that crosses midnight counts in the new window,
// and one that does not fit books into the next. A reply whose Redis TIME
// lies outside both (Redis's clock stepped) charged nothing, and the call
// is sent once more with windows around it (Admit's is not: its "not now"
// may have put the caller in the line, which is then served with the right
// windows). The key holds the window's start beside its count and expires
// at its end. Rules() reports the rule with Period the unit's nominal
// length (24h, 168h, 744h) and Burst its Count.
//
// A turn of Admit booked under a quota and never redeemed (its caller came
// back later than its Tolerance, or its slot fell inside a pause) gives
// its permits back to the quota's window at the subject's next Admit (or
// PrepayN) of the same rules, if that window is still the current one: a
// lapsed turn of a rate rule is only time gone by, but a quota's is
// capacity the window would lose. So the caller's new turn does not cost
// the window a second unit, and a subject's line waiting for the quota is
// served again at once. The bookings are kept as long as the quota's
// window for that.
//
// # Concurrency
//
// A Concurrency rule limits how many holders of a subject run at once,
// across every process: Limit.Count places, each held under a lease of
// Limit.Period (30s is a good value; it must be at least 100ms). Acquire
// takes a place and hands it back as a *Place, whose Release gives it
// back; while a place is held, the limiter renews its lease every third of
// the lease in the background (until Close), so a process killed with
// SIGKILL loses its places within the lease:
//
//	lim, err := throttle.New(rdb, throttle.Options{},
//		throttle.Rule{Name: "exports", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 5, Period: 30 * time.Second}},
//	)
//	place, err := lim.Acquire(ctx, "tenant-7", 1)
//	if err != nil {
//		return err
//	}
//	defer place.Release(context.WithoutCancel(ctx))
//	export()
//
// A caller that finds every place taken joins a first-come, first-served
// queue per subject, kept in Redis beside the holders (one sorted set:
// holders scored by their lease's expiry, waiters by their arrival). A
// place that frees — released, or an expired lease noticed by any call on
// the subject, a renewal of a live holder included — is handed to the head
// of the queue at once (a claim under the waiter's ID, with a lease, so no
// newcomer takes it), and the call that freed it names the waiter to
// Options.OnHandoff, which wakes it: the asynq worker moves the parked task
// to pending through its wake-up ledger (worker.WakeOnHandoff); a Wait in
// the same process is woken directly. If nobody is left to notice an
// expiry (every holder died), Admit with N = 0 does: it takes nothing,
// hands the expired places on, and says when the earliest lease expires
// while some wait (the asynq worker runs it as a sweep per subject in its
// wake-up ledger, once a lease while tasks wait). As a last resort each
// waiter also comes back on its own at its fallback, Admission.At: the
// first Count of the queue when the earliest lease expires, the next Count
// one lease later, and so on. A claim whose waiter never comes back
// expires like any lease. Admit with an ID (or a Waiter) is the same for
// queued jobs: Booked, with the Concurrency rule as Admission.Rule, means
// queued for a place; Granted or Redeemed means the caller holds one,
// Admission.Place, until it releases it. Admission.Lease is then the
// rule's lease (zero for answers that are not about a place).
//
// A Concurrency rule counts holders, not permits: n (a task's cost)
// charges the policy's rate rules only, and a holder takes one place. A
// policy may hold one Concurrency rule beside its rate rules ("20/s and at
// most 5 at once"), decided in the same script call: a caller runs only
// with both its place and its turn. A caller queued for a place takes no
// turn of the rate rules: it is charged when it has the place. A caller
// handed a place whose turn is further than it can wait books the turn and
// gives the place to the next waiter. A booked turn that comes due while
// every place is taken is kept, paid: the booking stays in the receipt set
// with its slot negated, so it neither goes stale nor is charged again,
// and the caller runs on it as soon as it has a place. Its permits were
// counted at its turn, so the rate rules' turns never exceed their limits;
// its start can come after its turn (and a few such starts can come
// together when places free together). AllowN and ReserveN do not take
// places (AllowN and AllowAtMost refuse a limiter with a Concurrency rule):
// use Acquire or Admit, and Place.Release. A Concurrency rule and the rules beside
// it are over the caller's subject: New refuses one in a limiter with
// Rule.Subject.
//
// Keys are <prefix>{<subject>}:<rule> (DefaultPrefix "jobthrottle:", the
// same default as the worker's rules file and enqueue), so all keys of a
// subject share one Redis Cluster slot; every key has a TTL no longer than
// it must remember. Inside a key, the subject is encoded for tools that
// inspect or clean up keys: ASCII letters, digits and -._~@/+=, stay as
// they are; every other byte is written %XX (upper-case hex). The encoding
// is injective, so two subjects never share a key, and has no '{' or '}',
// so a subject never ends the hash tag early. An empty subject, or one
// longer than 1024 bytes, is an error matching ErrInvalidSubject (hash long
// ones first); Rule.Validate checks a fixed Rule.Subject this way.
//
// For a cost known only afterwards (the tokens an LLM call used), reserve
// an estimate (ReserveN, PrepayN or Admit, which LocalLease never serves
// locally), act, then Reservation.Settle the real cost: in one script call
// the difference is given back, or charged, into debt if need be (later
// requests wait for it). Settling never lets a rule admit more than its
// bound: the windows correct the count where the reservation was counted (a
// fixed window only while that window lasts); a bucket gives back what it
// did not use as far as the reservations booked behind it leave room, which
// a burst larger than the estimates in flight at once makes all of it (see
// Settle). A policy whose rules count different things for one call
// (requests 1, input tokens N, output tokens M) charges each its own cost
// in the one decision (Costs: AllowCosts, ReserveCosts, AdmitRequest.Costs)
// and settles each to its real count (Reservation.SettleCosts).
//
// Settling composes with a parked backlog when its turns are booked
// within a Horizon (the subject's line) on bucket rules whose burst spans
// more than the horizon: what a settle gives back moves the bucket's
// schedule back, and since the line books its members only as they come
// within the horizon, the next members served are booked earlier and use
// it. A backlog of 2,000 calls whose estimates are 40 % above their real
// counts so uses over 95 % of the binding token rule (about 71 % without
// settling); a backlog booked without a horizon holds turns far ahead at
// their estimates, behind which a bucket can give back little.
//
// AllowN(ctx, subject, 0) reads a subject's state under every rule without
// charging it; AllowAtMost takes what there is, up to n; Reset forgets a
// subject (a reservation made before it gives nothing back); PauseFor holds every rule of a subject back until a time an
// upstream gave (package httpthrottle does this for HTTP responses).
//
// Upstream is where a limiter's requests meet the resource behind it:
// Depart books each request's departure on the subject's schedule and
// returns within DepartureTolerance of its slot (a departure held up by a
// Redis stall, a paused process or a busy machine is booked again rather
// than leaving with the next ones), and Learn records what the resource
// answered (a policy, a window, a 429), in Redis, for every process: the
// next departure anywhere reads it in the call that books it (package
// httpthrottle does both for HTTP requests).
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
// # One hot key: local runs of turns
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
// The bound on over-admission: a run of k permits is exactly k
// successive reservations, so a permit handed out at its slot keeps the
// exact bound; one handed out up to δ late moves by at most δ, so the
// permits admitted in any window of length W were all slotted in a window
// of W + δ:
//
//	admitted in any W ≤ Burst + Rate × (W + δ)
//
// that is, at most Rate × δ beyond the exact path's Burst + Rate × W,
// however many processes take runs, and whether they join, leave or die. With
// δ = 5ms that is 0.5 % of a per-second limit. The slots are placed on
// the local clock from each run's call's own round trip: Redis read its
// TIME after the call was sent and before the reply came, which brackets
// the local moment of every slot from both sides, so "not earlier" and
// "at most δ later" hold on the Redis clock, not only on this process's.
// A process that dies loses the slots it holds, at most two runs (4δ of
// the rate): an under-admission, never an over-admission.
//
// A run is sized from the process's demand r (permits asked for over
// the last 100ms) and the rate R: the least of 2δ·R, δ·r/(1 − r/R) (what
// arrivals at r can take before a slot is δ late) and δ·√(r·R)/4 (which
// keeps processes that use the key even: their parts of the rate converge), or
// what arrives during two refills if that is more (a refill: from deciding
// a run's call to serving the callers queued for it, which on a loaded
// machine is mostly waiting for a CPU); and it is at least what the
// process's callers waiting on Redis's exact answers asked for, so that a
// loaded process whose runs ran dry takes runs again. A run
// of fewer than 4 permits is not taken: at a few permits a second, every
// call is one exact decision in Redis, as without LocalLease. A process
// asks for its next run when it holds less than one (or than two refills
// of its demand), and gives back the unused tail of its runs once
// its requests stop; the bucket takes back what no later reservation has
// followed, as for a cancelled reservation, so under contention a refund
// may give back nothing.
//
// With runs, Result.Remaining counts the permits of its runs this process
// could hand out now, and a denied Allow's RetryAfter is when its next
// such permit is due (successive denials are told successive slots).
// ReserveN, Admit, PrepayN and AllowAtMost never take runs; a limiter
// with rules over several subjects cannot.
// PauseFor drops the slots this process holds; other processes hand out
// the ones they hold (at most two runs each) before they see the pause.
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
//	clock steps back by J a t before the last call's       as throttle: its TAT stays    TokenBucket and GCRA keep their state, a
//	                      keeps the tokens counted, and                                  time (the TAT): the bucket holds burst −
//	                      refills again from t                                           (TAT − now) × rate whole tokens, up to J ×
//	                                                                                     rate fewer than before the step (none
//	                                                                                     fewer once the clock is past the TAT), down
//	                                                                                     to 0 and into debt: the next permit comes
//	                                                                                     when the clock reaches the same Redis time,
//	                                                                                     up to J later
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
//	AllowAtMost           —                                grants ≥ 1 or denies;         the same; n capped at the burst/count;
//	                                                       AllowAtMost(0) reads          AllowAtMost(0) grants 0 and answers
//	                                                                                     as AllowN(0)
//	Reset                 —                                deletes the key               deletes every rule's keys and the pause; a
//	                                                                                     reservation made before it gives nothing
//	                                                                                     back into the new state (a settle for
//	                                                                                     more still charges it)
//	Reservation.Delay     time left from now               —                             the same, from the slot on the local clock
//	Cancel                after the time to act: nothing;  —                             the same, decided on Redis's clock; and a
//	                      before: n less what later                                      place held by later reservations comes
//	                      reservations took                                              back when those are cancelled too (x/time/
//	                                                                                     rate keeps it); a refusal by another
//	                                                                                     subject's rules gives back even after
//	                                                                                     the time to act
//	Wait                  fails at once past the deadline  — (loop Allow, sleep)         the same; also Options.MaxWait; windows
//	                                                                                     queue locally; *DelayError says when
//	settle (reserve, act, —                                —                             Reservation.Settle(actual): the difference
//	then the real cost)                                                                  given back or charged, atomically (see
//	                                                                                     Settle for how much a bucket gives back)
//	limit changes         SetLimit, SetBurst               per call                      a Limiter's rules are fixed; a new Limiter
//	                                                                                     reads the old state (rounded up); Admit's
//	                                                                                     bookings reach at most the Horizon ahead;
//	                                                                                     a reservation made before the change is
//	                                                                                     refunded or settled by the new interval
//	algorithms            token bucket                     GCRA                          both, plus three windows
package throttle
