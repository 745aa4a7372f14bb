package admission

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Wakeups is a ledger of parked jobs to wake at their turns, kept in Redis
// and scored on the Redis clock, shared by every process. A queue that
// schedules in whole seconds (asynq) would bring a job parked until 12.3 s
// back at 13 s, late for its turn, together with every other job of that
// second; a process running Run instead brings each back Lead before its
// turn, so that it waits a moment in place and starts on time.
//
// Members are opaque to the ledger: the adapter puts in them what its wake
// function needs (for asynq, the queue and the task ID).
type Wakeups struct {
	rdb redis.UniversalClient
	key string
}

var (
	//go:embed lua/wake_add.lua
	wakeAddSrc    string
	wakeAddScript = redis.NewScript(wakeAddSrc)
	//go:embed lua/wake_pop.lua
	wakePopSrc    string
	wakePopScript = redis.NewScript(wakePopSrc)
)

// Defaults of RunOptions.
const (
	// DefaultLead is how long before its turn a parked job is woken.
	DefaultLead = 250 * time.Millisecond
	// DefaultTick is the shortest Run sleeps between two looks at the
	// ledger while wake-ups come due one after another: each look takes
	// those due within Lead, so a look per Tick keeps them on time.
	DefaultTick = 50 * time.Millisecond
	// DefaultIdle is the longest Run sleeps between two looks at the
	// ledger, when nothing is due sooner (RunOptions.Idle).
	DefaultIdle = time.Second
	// wakeBatch bounds the wake-ups one look takes.
	wakeBatch = 256
	// wakeParallel bounds the wake functions running at once.
	wakeParallel = 16
	// ledgerKeepMs is how long the ledger outlives its latest wake-up.
	ledgerKeepMs = int64(time.Hour / time.Millisecond)
)

// NewWakeups returns the ledger kept at key on rdb. The key must be the
// same in every process that parks or wakes the same jobs; for Redis
// Cluster it is one key, in one slot.
func NewWakeups(rdb redis.UniversalClient, key string) (*Wakeups, error) {
	if rdb == nil {
		return nil, errors.New("admission: wakeups: nil Redis client")
	}
	if key == "" {
		return nil, errors.New("admission: wakeups: empty key")
	}
	return &Wakeups{rdb: rdb, key: key}, nil
}

// Add schedules member to be woken at slot, a time on the Redis clock
// (Decision.Slot). Adding a member again moves it.
func (w *Wakeups) Add(ctx context.Context, member string, slot time.Time) error {
	if err := wakeAddScript.Run(ctx, w.rdb, []string{w.key}, member, slot.UnixMicro(), ledgerKeepMs).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: add: %w", err)
	}
	return nil
}

// AddIfAbsent schedules member to be woken at slot, unless it is in the
// ledger already: then it stays where it is.
func (w *Wakeups) AddIfAbsent(ctx context.Context, member string, slot time.Time) error {
	if err := wakeAddScript.Run(ctx, w.rdb, []string{w.key}, member, slot.UnixMicro(), ledgerKeepMs, "NX").Err(); err != nil {
		return fmt.Errorf("admission: wakeups: add: %w", err)
	}
	return nil
}

// AddAll schedules each member of wakes to be woken at its time, in one
// call, as Add does.
func (w *Wakeups) AddAll(ctx context.Context, wakes map[string]time.Time) error {
	if len(wakes) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(wakes)+2)
	for m, at := range wakes {
		args = append(args, m, at.UnixMicro())
		if len(args) == 2 {
			args = append(args, ledgerKeepMs, "")
		}
	}
	if err := wakeAddScript.Run(ctx, w.rdb, []string{w.key}, args...).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: add: %w", err)
	}
	return nil
}

// Remove forgets member, if it is in the ledger.
func (w *Wakeups) Remove(ctx context.Context, member string) error {
	if err := w.rdb.ZRem(ctx, w.key, member).Err(); err != nil {
		return fmt.Errorf("admission: wakeups: remove: %w", err)
	}
	return nil
}

// Len returns how many wake-ups are in the ledger.
func (w *Wakeups) Len(ctx context.Context) (int64, error) {
	return w.rdb.ZCard(ctx, w.key).Result()
}

// RunOptions tunes Run. The zero value uses every default.
type RunOptions struct {
	// Lead is how long before its slot each job is woken. If zero,
	// DefaultLead. Keep it below Options.EarlyWait, so that a job woken on
	// time waits for its turn instead of parking again.
	Lead time.Duration
	// Tick is the shortest Run sleeps between looks, unless a look took
	// a full batch; also how much later a wake-up that returned
	// ErrWakeLater is tried again. If zero, DefaultTick.
	Tick time.Duration
	// Idle is the longest Run sleeps between looks: it sleeps until the
	// next wake-up it knows of is due, or until a process adds an earlier
	// one (Add publishes it), but no longer than Idle, in case a
	// notification was lost. If zero, DefaultIdle. An idle process thus
	// costs Redis one look per Idle.
	Idle time.Duration
	// OnError, if set, is called with every error of a look or a wake,
	// possibly from several goroutines at once.
	OnError func(error)
}

// Run wakes due jobs until ctx ends, then returns nil. Each due member is
// taken from the ledger by exactly one process and passed to wake (up to
// 16 at once, so wake must be safe for concurrent use); if wake returns an
// error matching ErrWakeLater, it is put back to be tried again one Tick
// later. Between looks Run sleeps until the next wake-up is due (at least
// Tick, at most Idle), and is woken sooner when a process adds an earlier
// one: it subscribes to the ledger's channel, on which Add publishes a
// wake-up that became the first. So it costs Redis one small script call
// per Idle while nothing is due, and about one per wake-up (at most one
// per Tick) while jobs come due.
func (w *Wakeups) Run(ctx context.Context, opts RunOptions, wake func(ctx context.Context, member string) error) error {
	if opts.Lead <= 0 {
		opts.Lead = DefaultLead
	}
	if opts.Tick <= 0 {
		opts.Tick = DefaultTick
	}
	report := func(err error) {
		if opts.OnError != nil && ctx.Err() == nil {
			opts.OnError(err)
		}
	}
	if opts.Idle <= 0 {
		opts.Idle = DefaultIdle
	}
	added, stop, ok := w.subscribe(ctx, report)
	defer stop()
	if !ok {
		opts.Idle = opts.Tick
	}
	for ctx.Err() == nil {
		members, next, redisNow, err := w.pop(ctx, opts.Lead)
		if err != nil {
			report(err)
			next = opts.Tick
		}
		// Wake concurrently: at a high rate one look takes many jobs, and
		// waking them one round trip after another would make the last
		// late for its turn.
		var wg sync.WaitGroup
		sem := make(chan struct{}, wakeParallel)
		for _, m := range members {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				err := wake(ctx, m)
				if errors.Is(err, ErrWakeLater) {
					// Not ready to be woken (still finishing its run,
					// say): one tick later, on the Redis clock.
					err = w.Add(ctx, m, redisNow.Add(opts.Tick+opts.Lead))
				}
				if err != nil {
					report(err)
				}
			}()
		}
		wg.Wait()
		if len(members) == wakeBatch {
			continue
		}
		w.sleep(ctx, sleepFor(next, opts), added)
	}
	return nil
}

// sleepFor returns how long Run sleeps after a look that found the next
// wake-up due in next (-1: none): until then, but at least Tick and at
// most Idle.
func sleepFor(next time.Duration, opts RunOptions) time.Duration {
	if next < 0 {
		return opts.Idle
	}
	return min(max(next, opts.Tick), opts.Idle)
}

// sleep waits d, or until ctx ends, or until a process adds a wake-up
// that became the ledger's first (from added): Run then looks at once.
func (w *Wakeups) sleep(ctx context.Context, d time.Duration, added <-chan struct{}) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-added:
	}
}

// subscribe listens on the ledger's channel, on which wake_add.lua
// publishes a wake-up that became the ledger's first, and signals each on
// the returned channel (one pending signal at most). stop closes the
// subscription. If the user may not subscribe (an ACL that grants no
// channels), it reports why and returns ok false: Run must then look every
// Tick, as nothing will tell it of an earlier wake-up. Other errors (Redis
// unreachable now) are reported and the subscription kept: go-redis
// subscribes again when it reconnects.
func (w *Wakeups) subscribe(ctx context.Context, report func(error)) (added <-chan struct{}, stop func(), ok bool) {
	sub := w.rdb.Subscribe(ctx, w.key)
	rctx, cancel := context.WithTimeout(ctx, subscribeTimeout)
	_, err := sub.Receive(rctx) // the subscription's confirmation
	cancel()
	if err != nil && strings.Contains(err.Error(), "NOPERM") {
		_ = sub.Close()
		report(fmt.Errorf("admission: wakeups: may not subscribe to %s (grant the user channel &%s), so looking every tick: %w", w.key, w.key, err))
		return nil, func() {}, false
	}
	if err != nil {
		report(fmt.Errorf("admission: wakeups: subscribing to %s: %w", w.key, err))
	}
	out := make(chan struct{}, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range sub.Channel() {
			select {
			case out <- struct{}{}:
			default: // a signal is pending already
			}
		}
	}()
	return out, func() {
		if err := sub.Close(); err != nil {
			report(fmt.Errorf("admission: wakeups: closing the subscription: %w", err))
		}
		<-done
	}, true
}

// subscribeTimeout bounds waiting for the ledger channel's subscription.
const subscribeTimeout = 5 * time.Second

// ErrWakeLater is returned (possibly wrapped) by a wake function that
// could not wake its job yet; Run tries again one Tick later.
var ErrWakeLater = errors.New("admission: wakeups: not ready; try again")

// pop takes the due members and returns them with the time until the
// next is due (-1 if none) and Redis's now.
func (w *Wakeups) pop(ctx context.Context, lead time.Duration) ([]string, time.Duration, time.Time, error) {
	v, err := wakePopScript.Run(ctx, w.rdb, []string{w.key}, lead.Microseconds(), wakeBatch).Slice()
	if err != nil {
		return nil, -1, time.Time{}, fmt.Errorf("admission: wakeups: take due: %w", err)
	}
	if len(v) != 3 {
		return nil, -1, time.Time{}, fmt.Errorf("admission: wakeups: unexpected reply %v", v)
	}
	raw, _ := v[0].([]any)
	members := make([]string, 0, len(raw))
	for _, m := range raw {
		if s, ok := m.(string); ok {
			members = append(members, s)
		}
	}
	next := time.Duration(-1)
	if us, ok := v[1].(int64); ok && us >= 0 {
		next = time.Duration(us) * time.Microsecond
	}
	now, _ := v[2].(int64)
	return members, next, time.UnixMicro(now), nil
}
